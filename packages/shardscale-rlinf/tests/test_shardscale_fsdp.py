"""ShardscaleFSDP on RLinf's FSDPModelManager (RLinf 0.3.0, FSDP2), 2 gloo ranks, an overflow.

The seam is RLinf's own ``FSDPModelManager``, the base class of its ``FSDPActor``:
built with its real ``__init__`` (device mesh, FSDP strategy, AMP context),
``setup_model_and_optimizer`` (RLinf's ``fully_shard`` wrapping, its AdamW, its LR
scheduler, its ``build_grad_scaler``), ``optimizer_step``, and its checkpoint
methods (DCP). What is not RLinf's, and why:

* the model: ``model_provider_func`` is overridden (as RLinf's own
  ``EmbodiedFSDPActor`` does) to build a tiny Qwen2 from a config with SDPA
  attention: RLinf's loads weights from disk with ``flash_attention_2`` hard-coded;
* the CPU: RLinf finds no accelerator here (``Worker.torch_device_type`` is
  None), so the test sets the two class attributes RLinf's worker sets at start-up
  (``Worker.torch_device_type``/``torch_platform``) to "cpu" and a CPU platform;
* the training step: ``FSDPActor.training_step`` needs a Ray cluster (its
  ``Worker.__init__`` calls ``ray.init(address="auto")``), so the test runs the same
  sequence around the manager by hand: ``zero_grad``, ``before_micro_batch``,
  ``grad_scaler.scale(loss).backward()`` per micro-batch, ``optimizer_step()``,
  ``lr_scheduler.step()``.

"shardscale" runs mix ``ShardscaleFSDP`` in; "rlinf" runs are what RLinf ships,
torch's ``ShardedGradScaler``, made to run here by giving it the CPU device (RLinf
creates it without one: it defaults to "cuda" and disables itself on a CPU). Both
are compared with a hand-written torch loop that clips the true global norm once.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("rlinf", reason="RLinf is installed only by `nox -s rlinf`")
from mp_harness import Pool

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

STEPS = 6
INJECT = {2: 1}  # step -> the one rank whose loss is inf at that step
SAVE_AFTER = 4  # the checkpoint is written after this many steps
INIT_SCALE = 1024.0
CLIP = 0.3
LR = 0.5
WARMUP = 4  # RLinf's "constant" schedule with warmup: lr = LR * min(1, t / WARMUP) after t steps
# adam_eps 1.0, far above the gradients' size (about 1e-2 per element): AdamW's update is then
# close to lr * g, so a wrong clip coefficient shows in the weights (with a tiny eps Adam's
# update is about lr * sign(g), whatever the clip).
ADAM_EPS = 1.0
VOCAB, SEQ, PROMPT, PER_RANK, MICRO = 64, 12, 4, 4, 2
U16 = torch.finfo(torch.float16).eps / 2  # fp16 unit roundoff, 2**-11
# Both runs do the forward and backward in fp16 (FSDP2's param_dtype; the reference casts the
# same parameters), in another order (2 ranks x 2 micro-batches reduced in fp32 vs one process
# summing in fp64): each gradient carries about 16 fp16 roundings (2 layers, attention + MLP +
# norm, forward and backward), so the runs differ by at most about 32 u in the norms and in the
# weights' movement compared here. The shard-norm clip this catches moves weights by ~40 %.
PARITY_RTOL = 32 * U16


@pytest.fixture(scope="module")
def pool2() -> Any:
    pool = Pool(2, case_timeout=420.0)
    try:
        yield pool
    finally:
        pool.close()


# -- what RLinf needs on a CPU -------------------------------------------------------------------


class _CpuPlatform:
    """The parts of a torch device module RLinf's FSDP path calls, for the CPU."""

    def is_available(self) -> bool:
        return False  # RLinf then saves and restores only the CPU's RNG (get_rng_state)

    def set_device(self, device: int) -> None:
        pass

    def current_device(self) -> str:
        return "cpu"

    def synchronize(self) -> None:
        pass

    def ipc_collect(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass


def _cpu_worker() -> None:
    from rlinf.scheduler import Worker

    Worker.torch_device_type = "cpu"
    Worker.torch_platform = _CpuPlatform()
    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # what RLinf's launcher sets


def _config(grad_scaler: bool = True) -> Any:
    """An RLinf actor config, completed by RLinf's own validate_fsdp_cfg."""
    from omegaconf import OmegaConf
    from rlinf.config import validate_fsdp_cfg

    cfg = OmegaConf.create({
        "model": {"precision": "fp32"},
        "optim": {
            "lr": LR, "adam_beta1": 0.9, "adam_beta2": 0.95,
            "adam_eps": ADAM_EPS, "weight_decay": 0.0, "clip_grad": CLIP,
            "lr_scheduler": "constant", "lr_warmup_steps": WARMUP, "total_training_steps": 100,
        },
        "fsdp_config": {
            "strategy": "fsdp2",
            "mixed_precision": {"param_dtype": "fp16", "reduce_dtype": "fp32",
                                "buffer_dtype": "fp32"},
            "grad_scaler": {"enabled": grad_scaler, "init_scale": INIT_SCALE,
                            "growth_interval": 400},
        },
    })  # fmt: skip
    return validate_fsdp_cfg(cfg)


def _tiny_lm() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model: torch.nn.Module = AutoModelForCausalLM.from_config(config)
    return model


def _manager(kind: str, **config: Any) -> Any:
    """RLinf's FSDPModelManager, set up; with ShardscaleFSDP mixed in for "shardscale"."""
    _cpu_worker()
    from rlinf.hybrid_engines.fsdp.fsdp_model_manager import FSDPModelManager

    class Manager(FSDPModelManager):  # type: ignore[misc]
        def model_provider_func(self) -> torch.nn.Module:
            return _tiny_lm()

    if kind == "shardscale":
        from shardscale.rlinf import ShardscaleFSDP

        class Shardscale(ShardscaleFSDP, Manager):
            pass

        cls: type = Shardscale
    else:

        class RLinf(Manager):
            def build_grad_scaler(self, enabled: bool, **kwargs: Any) -> Any:
                # RLinf's own line, ShardedGradScaler(enabled=enabled, **kwargs), on the CPU
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                return ShardedGradScaler("cpu", enabled=enabled, **kwargs)

        cls = RLinf
    manager = cls(_config(**config), dist.get_world_size(), dist.get_rank())
    manager.setup_model_and_optimizer()
    return manager


# -- the data, the loss and the training step ----------------------------------------------------


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s fixed batch: token ids and the loss mask (the response part)."""
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=g)
    mask = torch.zeros(PER_RANK, SEQ)
    mask[:, PROMPT:] = 1
    return ids, mask


def _nll(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean negative log-likelihood of the response tokens, in fp32."""
    logp = torch.log_softmax(logits.float()[:, :-1], dim=-1)
    picked = logp.gather(-1, ids[:, 1:, None])[..., 0]
    m = mask[:, 1:]
    return -(picked * m).sum() / m.sum()


def _full_params(manager: Any) -> list[torch.Tensor]:
    out = []
    for p in manager.model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(full.detach().to(torch.float32).clone())
    return out


def _train(manager: Any, steps: range) -> list[dict[str, Any]]:
    """FSDPActor.training_step's sequence around the manager, one mini-batch per step."""
    rank = dist.get_rank()
    ids, mask = _batch(rank)
    micros = PER_RANK // MICRO
    rows = []
    manager.model.train()
    for step in steps:
        scale = manager.grad_scaler.get_scale()
        manager.optimizer.zero_grad()
        for i in range(micros):
            ctx = manager.before_micro_batch(manager.model, is_last_micro_batch=i + 1 == micros)
            x, m = ids[i * MICRO : (i + 1) * MICRO], mask[i * MICRO : (i + 1) * MICRO]
            with manager.amp_context:
                logits = manager.model(input_ids=x, attention_mask=torch.ones_like(x)).logits
            loss = _nll(logits, x, m) / micros
            if INJECT.get(step) == rank:
                loss = loss * math.inf
            with ctx:
                manager.grad_scaler.scale(loss).backward()
        grad_norm, lr_list = manager.optimizer_step()
        manager.lr_scheduler.step()
        metrics = manager.shardscale_metrics() if hasattr(manager, "shardscale_metrics") else {}
        rows.append({"grad_norm": float(grad_norm), "lr": lr_list[0], "metrics": metrics,
                     "scale_before": scale, "scale_after": manager.grad_scaler.get_scale(),
                     "sched": manager.lr_scheduler.last_epoch,
                     "params": _full_params(manager)})  # fmt: skip
    return rows


# -- the hand-written torch loop -------------------------------------------------------------------


def _reference() -> dict[str, Any]:
    """The run RLinf's manager must match: the same model, data and loss in one process, by hand.

    Each step: every rank's micro-batch losses (each divided by the micro-batch count) through
    fp16 parameters (buffers stay fp32, as under FSDP2's MixedPrecisionPolicy), scaled; the
    gradients summed in fp64, averaged over the 2 ranks (FSDP2's reduce-scatter) and unscaled;
    the true global norm; one clip; torch's AdamW on the fp32 weights, at RLinf's warm-up
    learning rate. The injected step is skipped: no update, the scale halves, the learning
    rate holds (the schedule counts the steps that updated the policy).
    """
    model = _tiny_lm()
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.95), eps=ADAM_EPS, weight_decay=0.0
    )
    # RLinf's build_optimizer ends with warmup_optimizer_state: one step with zero gradients at
    # lr 0, which creates the state and counts as AdamW's first step (its bias correction).
    for group in opt.param_groups:
        group["lr"] = 0.0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    batches = [_batch(r) for r in range(2)]
    micros = PER_RANK // MICRO
    scale, taken = INIT_SCALE, 0
    norms: list[float] = []
    params: list[list[torch.Tensor]] = []
    initial = [p.detach().clone() for p in model.parameters()]
    for step in range(STEPS):
        if step in INJECT:
            scale *= 0.5
            norms.append(math.inf)
            params.append([p.detach().clone() for p in model.parameters()])
            continue
        half = copy.deepcopy(model)
        for p in half.parameters():
            p.data = p.data.half()
        total = [torch.zeros(p.shape, dtype=torch.float64) for p in half.parameters()]
        for ids, mask in batches:
            for i in range(micros):
                x, m = ids[i * MICRO : (i + 1) * MICRO], mask[i * MICRO : (i + 1) * MICRO]
                half.zero_grad()
                logits = half(input_ids=x, attention_mask=torch.ones_like(x)).logits
                ((_nll(logits, x, m) / micros) * scale).backward()
                for t, p in zip(total, half.parameters(), strict=True):
                    t.add_(p.grad.to(torch.float64))
        grads = [t / 2 / scale for t in total]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        coef = min(1.0, CLIP / (norm + 1e-6))
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = (coef * g).to(torch.float32)
        for group in opt.param_groups:
            group["lr"] = LR * min(1.0, taken / WARMUP)
        opt.step()
        taken += 1
        norms.append(norm)
        params.append([p.detach().clone() for p in model.parameters()])
    return {"norms": norms, "params": params, "initial": initial}


# -- the cases (run on every rank) ---------------------------------------------------------------


def _case(kind: str, workdir: str) -> dict[str, Any]:
    ckpt = os.path.join(workdir, f"ckpt-{kind}")
    manager = _manager(kind)
    out: dict[str, Any] = {"scaler": type(manager.grad_scaler).__module__}
    out["initial"] = _full_params(manager)
    rows = _train(manager, range(SAVE_AFTER))
    out["params_at_save"] = _full_params(manager)
    manager.save_checkpoint(ckpt, SAVE_AFTER)
    out["files"] = sorted(os.listdir(ckpt))
    rows += _train(manager, range(SAVE_AFTER, STEPS))
    out["rows"] = rows
    # Resume: a fresh manager, as RLinf builds it on restart, then the checkpoint.
    manager2 = _manager(kind)
    manager2.load_checkpoint(ckpt)
    out["loaded_scale"] = manager2.grad_scaler.get_scale()
    out["loaded_sched"] = manager2.lr_scheduler.last_epoch
    out["loaded_params"] = _full_params(manager2)
    out["resumed"] = _train(manager2, range(SAVE_AFTER, STEPS))
    if dist.get_rank() == 0:
        out["reference"] = _reference()
    return out


def _bf16_guard_case() -> dict[str, Any]:
    """``grad_scaler.enabled: false`` (RLinf's bf16/fp32 default): the guard, no scaling."""
    manager = _manager("shardscale", grad_scaler=False)
    rows = _train(manager, range(4))
    return {
        "loss_scaling": manager.grad_scaler.loss_scaling,
        "skipped": [r["metrics"]["actor/step_skipped"] for r in rows],
        "scales": [r["metrics"]["actor/loss_scale"] for r in rows],
        "norms": [r["grad_norm"] for r in rows],
        "params": [r["params"] for r in rows],
    }


def _bad_input_case(workdir: str) -> dict[str, Any]:
    """Each refusal, and that a refused state load leaves the scaler as it was."""
    import rlinf  # noqa: F401

    from shardscale.rlinf import TESTED_RLINF, contract_problems

    errors: dict[str, str | None] = {}
    manager = _manager("shardscale")
    scaler = manager.grad_scaler
    from shardscale.rlinf._mixin import _state

    state = _state(manager)
    manager.critic_warmup_steps = 2  # what RLinf sets from optim.critic_warmup_steps
    try:
        manager.build_grad_scaler(True, init_scale=2.0)
    except ValueError as exc:
        errors["critic_warmup"] = str(exc)
    else:
        errors["critic_warmup"] = None
    manager.critic_warmup_steps = 0
    kept = _state(manager) is state and manager.grad_scaler is scaler
    before = state.state_dict()
    for name, bad in (
        ("bad_counter", {**before, "skipped_steps": -1}),
        ("bad_scaler", {**before, "scaler": {**before["scaler"], "scale": -1.0}}),
        ("not_ours", {"scale": 2.0}),
    ):
        try:
            state.load_state_dict(bad)
        except ValueError as exc:
            errors[name] = str(exc)
        else:
            errors[name] = None
    import importlib.metadata as md

    return {
        "errors": errors,
        "state_unchanged": kept and state.state_dict() == before,
        "scale": manager.grad_scaler.get_scale(),
        "contract": contract_problems(manager),
        "versions": (TESTED_RLINF, md.version("rlinf")),
    }


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all parameters."""
    diff = math.sqrt(
        sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(a, b, strict=True))
    )
    ref = math.sqrt(sum(float(y.double().pow(2).sum()) for y in b))
    return diff / ref


def _moved(a: list[torch.Tensor], start: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """How far a's update from ``start`` is from b's, relative to b's update."""
    return _rel(
        [x - s for x, s in zip(a, start, strict=True)],
        [y - s for y, s in zip(b, start, strict=True)],
    )


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def runs(pool2: Pool, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    workdir = str(tmp_path_factory.mktemp("rlinf"))
    return {kind: pool2.run(_case, kind, workdir) for kind in ("shardscale", "rlinf")}


def test_shardscale_skips_on_every_rank_and_matches_the_hand_loop(runs: dict[str, Any]) -> None:
    results = runs["shardscale"]
    ref = results[0]["reference"]
    assert all(n > CLIP for n in ref["norms"])  # the clip acts on every taken step
    assert _same(results[0]["initial"], ref["initial"])  # the same model on both sides
    for res in results:
        rows = res["rows"]
        # Both ranks skip exactly the injected step, and the metrics say so.
        assert [r["metrics"]["actor/step_skipped"] for r in rows] == [
            1.0 if s in INJECT else 0.0 for s in range(STEPS)
        ]
        expected = [INIT_SCALE * 0.5 ** sum(1 for k in INJECT if k < s) for s in range(STEPS)]
        assert [r["metrics"]["actor/loss_scale"] for r in rows] == expected
        assert [r["scale_before"] for r in rows] == expected
        for s in INJECT:  # the skipped step left the weights as they were
            assert _same(rows[s]["params"], rows[s - 1]["params"])
        # The scheduler held on the skipped step: it counts taken steps only.
        taken = [sum(1 for k in range(s + 1) if k not in INJECT) for s in range(STEPS)]
        assert [r["sched"] for r in rows] == taken
        # RLinf's grad_norm (actor/grad_norm) is the true global norm (inf/nan when skipped).
        for r, want in zip(rows, ref["norms"], strict=True):
            got = r["grad_norm"]
            if math.isinf(want):
                assert not math.isfinite(got)
            else:
                assert got == pytest.approx(want, rel=PARITY_RTOL), (got, want)
        assert res["scaler"].startswith("shardscale.")
    # The same norm on both ranks, the same weights, and the hand loop's within fp16's reach.
    assert [r["grad_norm"] for r in results[0]["rows"] if math.isfinite(r["grad_norm"])] == [
        r["grad_norm"] for r in results[1]["rows"] if math.isfinite(r["grad_norm"])
    ]
    assert _same(results[0]["rows"][-1]["params"], results[1]["rows"][-1]["params"])
    # (The first step runs at warm-up's learning rate 0: nothing moves yet.)
    assert _same(results[0]["rows"][0]["params"], ref["initial"])
    for row, want in zip(results[0]["rows"][1:], ref["params"][1:], strict=True):
        assert _moved(row["params"], ref["initial"], want) < PARITY_RTOL


def test_shardscale_checkpoint_resumes_exactly(runs: dict[str, Any]) -> None:
    saved_scale = INIT_SCALE * 0.5 ** sum(1 for k in INJECT if k < SAVE_AFTER)
    for res in runs["shardscale"]:
        assert {"shardscale_world_size_2_rank_0.pt", "shardscale_world_size_2_rank_1.pt"} <= set(
            res["files"]
        )
        assert res["loaded_scale"] == saved_scale  # not the config's init_scale
        assert res["loaded_sched"] == sum(1 for k in range(SAVE_AFTER) if k not in INJECT)
        assert _same(res["loaded_params"], res["params_at_save"])
        # The resumed steps are the uninterrupted run's, bit for bit.
        for a, b in zip(res["resumed"], res["rows"][SAVE_AFTER:], strict=True):
            assert a["grad_norm"] == b["grad_norm"] and a["metrics"] == b["metrics"]
            assert _same(a["params"], b["params"])


def test_what_rlinf_ships_in_the_same_manager_shows_what_shardscale_fixes(
    runs: dict[str, Any],
) -> None:
    """RLinf's recipe with torch's scaler on the CPU: this passing means the gaps reproduce."""
    results = runs["rlinf"]
    ref = runs["shardscale"][0]["reference"]
    for res in results:
        rows = res["rows"]
        assert res["scaler"] == "torch.distributed.fsdp.sharded_grad_scaler"
        # torch's scaler does skip the overflow on both ranks (its scale backs off) ...
        assert [r["scale_after"] for r in rows][2] == INIT_SCALE / 2
        assert _same(rows[2]["params"], rows[1]["params"])
        # ... but RLinf's scheduler advanced on it (it counts every step, taken or not) ...
        assert [r["sched"] for r in rows] == list(range(1, STEPS + 1))
        # ... and the scale is not in RLinf's checkpoint: a resumed run starts from the config's.
        assert not any(f.startswith("shardscale_") for f in res["files"])
        assert res["loaded_scale"] == INIT_SCALE
    # Each rank's grad_norm is the norm of its own shard (RLinf's FSDP2 strategy reduces over
    # no group on a 1-D mesh): the ranks log different norms at every taken step ...
    for s in range(STEPS):
        n0, n1 = (res["rows"][s]["grad_norm"] for res in results)
        assert (n0 != n1) if s not in INJECT else not (math.isfinite(n0) or math.isfinite(n1))
    # ... and at the first step (same weights as the reference) the two shard norms together
    # make the true global norm, which neither rank logged.
    n0, n1 = (res["rows"][0]["grad_norm"] for res in results)
    want = ref["norms"][0]
    assert max(n0, n1) < want * (1 - PARITY_RTOL)
    assert math.hypot(n0, n1) == pytest.approx(want, rel=PARITY_RTOL)
    # Clipped with shard norms, the weights moved away from the run that clips the true norm.
    assert _moved(results[0]["rows"][-1]["params"], ref["initial"], ref["params"][-1]) > (
        4 * PARITY_RTOL
    )


def test_bf16_config_gets_the_guard(pool2: Pool) -> None:
    """``grad_scaler.enabled: false``: no loss scaling, the overflow step skipped on both ranks."""
    results = pool2.run(_bf16_guard_case)
    for res in results:
        assert res["loss_scaling"] is False
        assert res["skipped"] == [0.0, 0.0, 1.0, 0.0]
        assert res["scales"] == [1.0] * 4
        assert not math.isfinite(res["norms"][2])
        assert all(math.isfinite(n) for i, n in enumerate(res["norms"]) if i != 2)
        assert _same(res["params"][2], res["params"][1])
        assert all(bool(torch.isfinite(p).all()) for p in res["params"][-1])
    assert _same(results[0]["params"][-1], results[1]["params"][-1])


def test_bad_input_is_refused_and_changes_nothing(
    pool2: Pool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    for res in pool2.run(_bad_input_case, str(tmp_path_factory.mktemp("bad"))):
        errors = res["errors"]
        assert (
            errors["critic_warmup"] is not None and "critic_warmup_steps" in errors["critic_warmup"]
        )
        assert errors["bad_counter"] is not None and "skipped_steps" in errors["bad_counter"]
        assert errors["bad_scaler"] is not None and "scale" in errors["bad_scaler"]
        assert errors["not_ours"] is not None and "not written by it" in errors["not_ours"]
        assert res["state_unchanged"] and res["scale"] == INIT_SCALE
        # The installed RLinf is the tested one, and has everything ShardscaleFSDP relies on.
        assert res["contract"] == []
        assert res["versions"][0] == res["versions"][1]


def test_listed_by_the_registry_without_importing_rlinf() -> None:
    code = (
        "import json, sys\n"
        "from shardscale.core import get_registry\n"
        "info = [p for p in get_registry().plugins() if p.name == 'rlinf']\n"
        "print(json.dumps({'info': [[i.distribution, list(i.hooks)] for i in info],"
        " 'imported': 'rlinf' in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"info": [["shardscale-rlinf", []]], "imported": False}
