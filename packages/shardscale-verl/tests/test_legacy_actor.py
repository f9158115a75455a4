"""use_shardscale on verl 0.7's legacy actor (verl 0.7.1, FSDP2 and FSDP1), 2 gloo ranks, one overflow.

Everything here is verl's own code: ``DataParallelPPOActor`` built from verl's
``FSDPActorConfig`` around a tiny Qwen2 created from a config (no download, no
tokenizer) and sharded as verl's worker does it (FSDP2 with verl's
``apply_fsdp2``, FSDP1 with verl's wrap policy; fp16 compute, fp32 reduction:
see ``_actor``), trained with verl's
``update_policy`` (the vanilla PPO loss, on-policy: one mini-batch of two
micro-batches per RL step), checkpointed with verl's ``FSDPCheckpointManager``.
verl's actor runs on a CPU as it is (``use_remove_padding=False``,
``attn_implementation="sdpa"``); verl's ``ActorRolloutRefWorker`` (Ray) is not
used: its ``init_model`` builds the same actor and checkpoint manager.

"shardscale" runs apply ``use_shardscale(actor, checkpoint_manager=...)``;
"torch" runs give the same actor torch's ``ShardedGradScaler`` on the CPU
device, which is what verl builds (its own is created without a device,
defaults to "cuda" and disables itself here: the "shipped" case shows that).
Both are compared with a hand-written torch loop that clips the true global
norm once per step and skips the injected step.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool

verl = pytest.importorskip("verl", reason="verl is installed only by `nox -s verl_legacy`")
if not verl.__version__.startswith("0.7."):
    pytest.skip(
        f"verl 0.7's legacy actor; verl {verl.__version__} is installed (`nox -s verl_legacy`)",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

STEPS = 6
INJECT = {2: 1}  # RL step -> the one rank whose advantages hold an inf at that step
SAVE_AFTER = 4  # the checkpoint is written after this many RL steps
INIT_SCALE = 1024.0
CLIP = 0.5
LR = 0.5
VOCAB, PROMPT, RESPONSE, PER_RANK, MICRO = 64, 4, 8, 4, 2
SEQ = PROMPT + RESPONSE
U16 = torch.finfo(torch.float16).eps / 2  # fp16 unit roundoff, 2**-11
# The actor and the reference both run the model's forward and backward in fp16 (FSDP's
# fp16 compute, verl's fp16 autocast), in another order (2 ranks x 2 micro-batches, each
# reduce-scattered in fp32 and averaged, vs one process accumulating in fp32): each gradient
# carries about 16 fp16 roundings of its own (2 layers, each attention + MLP + norm, forward
# and backward), and the two runs differ by at most the sum, 32 u, in the norms and in the
# parameter updates compared here.
PARITY_RTOL = 32 * U16
# torch's clip and shardscale's measure the same fp32 gradients (FSDP2 reduce-scatters them in
# fp32) in another summation order: each sum of squares over at most 2**15 elements, pairwise,
# carries about 15 fp32 roundings, the square root halves it, and the clipped updates that
# follow differ by as little: 32 eps of fp32 bounds it with room.
NORM_RTOL = 32 * torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def pool2() -> Any:
    pool = Pool(2, case_timeout=420.0)
    try:
        yield pool
    finally:
        pool.close()


# -- verl's actor on a CPU -------------------------------------------------------------------------


def _write_model(model_dir: str) -> None:
    """A tiny Qwen2 from a config, saved by rank 0 (every rank loads the same weights)."""
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(model_dir, "config.json")):
        from transformers import AutoModelForCausalLM, Qwen2Config

        config = Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    dist.barrier()


def _actor(model_dir: str, dtype: str = "float16", strategy: str = "fsdp2") -> tuple[Any, Any]:
    """verl's actor and checkpoint manager, built as ActorRolloutRefWorker.init_model builds them.

    FSDP2 through verl's ``apply_fsdp2``; FSDP1 (verl 0.7's default strategy) as verl's
    worker wraps it, except ``sync_module_states=False`` and ``device_id`` "cpu" (torch
    refuses the first on a CPU, and FSDP1 wants the second without an accelerator).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM
    from verl.trainer.config import CheckpointConfig
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import apply_fsdp2
    from verl.workers.actor.dp_actor import DataParallelPPOActor
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig

    short = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="sdpa"
    )
    fsdp_config = FSDPEngineConfig(strategy=strategy, dtype=dtype)
    if strategy == "fsdp2":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
        policy = MixedPrecisionPolicy(
            param_dtype=short, reduce_dtype=torch.float32, cast_forward_inputs=True
        )
        apply_fsdp2(
            model, {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": True}, fsdp_config
        )
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from verl.utils.fsdp_utils import get_fsdp_wrap_policy

        model = FullyShardedDataParallel(
            model, auto_wrap_policy=get_fsdp_wrap_policy(model, config=None),
            mixed_precision=MixedPrecision(
                param_dtype=short, reduce_dtype=torch.float32, buffer_dtype=torch.float32
            ),
            sync_module_states=False, use_orig_params=False, device_id=torch.device("cpu"),
        )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    config = FSDPActorConfig(
        strategy=strategy, rollout_n=1, ppo_mini_batch_size=PER_RANK,
        ppo_micro_batch_size_per_gpu=MICRO, grad_clip=CLIP, use_torch_compile=False,
        use_remove_padding=False, fsdp_config=fsdp_config,
    )  # fmt: skip
    actor = DataParallelPPOActor(config=config, actor_module=model, actor_optimizer=optimizer)
    manager = FSDPCheckpointManager(
        model=model, optimizer=optimizer, lr_scheduler=None, processing_class=None,
        checkpoint_config=CheckpointConfig(),
    )  # fmt: skip
    return actor, manager


# -- the data ---------------------------------------------------------------------------------------


def _batch(rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s fixed rollout: prompt + response ids, masks, advantages."""
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=g)
    attention = torch.ones(PER_RANK, SEQ, dtype=torch.long)
    attention[1, -3:] = 0  # responses that ended early (padding after EOS)
    attention[2, -1:] = 0
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "position_ids": torch.arange(SEQ).expand(PER_RANK, SEQ).contiguous(),
        "responses": ids[:, PROMPT:],
        "response_mask": attention[:, PROMPT:].clone(),
        "advantages": torch.randn(PER_RANK, RESPONSE, generator=g),
    }


def _data(rank: int, inject: bool) -> Any:
    from tensordict import TensorDict
    from verl import DataProto

    batch = _batch(rank)
    if inject:
        batch["advantages"] = batch["advantages"].clone()
        batch["advantages"][0, 0] = math.inf  # one response token of this rank's rollout
    # on-policy (one mini-batch, one epoch): verl uses the current log-probs as the old ones
    batch["old_log_probs"] = torch.zeros(PER_RANK, RESPONSE)
    return DataProto(batch=TensorDict(batch, batch_size=[PER_RANK]), meta_info={"temperature": 1.0})


def _full_params(module: Any) -> list[torch.Tensor]:
    """Every parameter, whole (FSDP2: gathered DTensors; FSDP1: inside summon_full_params)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(module, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(module, writeback=False):
            return [p.detach().to(torch.float32).clone() for p in module.parameters()]
    out = []
    for p in module.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(full.detach().to(torch.float32).clone())
    return out


def _train(actor: Any, steps: range) -> list[dict[str, Any]]:
    rank = dist.get_rank()
    rows = []
    for step in steps:
        scale = actor.scaler.get_scale()
        metrics = actor.update_policy(_data(rank, INJECT.get(step) == rank))
        rows.append({"metrics": dict(metrics), "scale_before": scale,
                     "scale_after": actor.scaler.get_scale(),
                     "params": _full_params(actor.actor_module)})  # fmt: skip
    return rows


# -- the hand-written torch loop -------------------------------------------------------------------


def _reference(model_dir: str) -> dict[str, Any]:
    """The run the actor must match: the same model, data and loss in one process, by hand.

    Each step: the fp16 model's gradient of verl's on-policy PPO loss (ratio 1, so the
    gradient of -advantage * log-prob, token-mean over each micro-batch's response mask,
    times 1/2 for the two micro-batches, averaged over the 2 ranks as FSDP does), summed in
    fp32, unscaled, the true global norm, one clip, SGD. The injected step is skipped: no
    update, the scale halves.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="sdpa"
    )
    batches = [_batch(r) for r in range(2)]
    scale = INIT_SCALE
    norms: list[float] = []
    params: list[list[torch.Tensor]] = []
    initial = [p.detach().clone() for p in model.parameters()]
    for step in range(STEPS):
        if step in INJECT:
            scale *= 0.5
            norms.append(math.inf)
            params.append([p.detach().clone() for p in model.parameters()])
            continue
        half = copy.deepcopy(model).half()
        total = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
        for b in batches:
            for i in range(0, PER_RANK, MICRO):
                rows = slice(i, i + MICRO)
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = half(
                        input_ids=b["input_ids"][rows], attention_mask=b["attention_mask"][rows],
                        position_ids=b["position_ids"][rows], use_cache=False,
                    ).logits  # fmt: skip
                logits = logits[:, PROMPT - 1 : -1].float()
                logp = torch.log_softmax(logits, dim=-1)
                picked = logp.gather(-1, b["responses"][rows, :, None])[..., 0]
                mask = b["response_mask"][rows].float()
                loss = -(b["advantages"][rows] * picked * mask).sum() / mask.sum()
                (loss * scale / (2 * 2)).backward()  # 2 micro-batches, 2 ranks averaged
                for acc, p in zip(total, half.parameters(), strict=True):
                    acc.add_(p.grad.float())
                    p.grad = None
        grads = [g.to(torch.float64) / scale for g in total]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        coef = min(1.0, CLIP / (norm + 1e-6))
        with torch.no_grad():
            for param, g in zip(model.parameters(), grads, strict=True):
                param.sub_((LR * coef * g).to(torch.float32))
        norms.append(norm)
        params.append([p.detach().clone() for p in model.parameters()])
    return {"norms": norms, "params": params, "initial": initial}


# -- the cases (run on every rank) -----------------------------------------------------------------


def _case(run: str, workdir: str) -> dict[str, Any]:
    kind, _, fsdp1 = run.partition("-")  # "shardscale-fsdp1": the same with FSDP1
    strategy = "fsdp" if fsdp1 else "fsdp2"
    model_dir = os.path.join(workdir, "model")
    ckpt = os.path.join(workdir, f"ckpt-{run}")
    _write_model(model_dir)
    actor, manager = _actor(model_dir, strategy=strategy)
    out: dict[str, Any] = {
        "verl_scaler": type(actor.scaler).__name__,
        "verl_scaler_enabled": actor.scaler.is_enabled(),
    }
    if kind == "shardscale":
        from shardscale.verl import use_shardscale

        use_shardscale(actor, checkpoint_manager=manager, init_scale=INIT_SCALE)
    elif kind == "torch":  # what verl builds, on the device it runs on
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        actor.scaler = ShardedGradScaler("cpu", init_scale=INIT_SCALE, growth_interval=400)
    # kind == "shipped": verl's own scaler, as verl built it (for "cuda")
    out["scaler"] = type(actor.scaler).__module__
    out["initial"] = _full_params(actor.actor_module)
    rows = _train(actor, range(SAVE_AFTER))
    if kind != "shipped":
        manager.save_checkpoint(ckpt, global_step=SAVE_AFTER)
        out["files"] = sorted(os.listdir(ckpt))
    rows += _train(actor, range(SAVE_AFTER, STEPS))
    out["rows"] = rows
    if kind == "shipped":
        return out
    # Resume: a fresh actor and manager, as verl's worker builds them on restart, then the
    # checkpoint.
    actor2, manager2 = _actor(model_dir, strategy=strategy)
    if kind == "shardscale":
        from shardscale.verl import use_shardscale

        use_shardscale(actor2, checkpoint_manager=manager2)  # verl's default initial scale
    else:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        actor2.scaler = ShardedGradScaler("cpu", growth_interval=400)  # verl's, on the CPU
    manager2.load_checkpoint(ckpt)
    out["loaded"] = {
        "scale": actor2.scaler.get_scale(),
        "params": _full_params(actor2.actor_module),
    }
    out["resumed"] = _train(actor2, range(SAVE_AFTER, STEPS))
    if run == "shardscale" and dist.get_rank() == 0:
        out["reference"] = _reference(model_dir)
    return out


def _auto_case(workdir: str) -> dict[str, Any]:
    """``model.external_lib=shardscale.verl.auto``: verl imports it before it builds its actor."""
    import sys

    from verl.utils.import_utils import import_external_libs
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    from shardscale.verl import is_using_shardscale

    model_dir = os.path.join(workdir, "model")
    _write_model(model_dir)
    original = DataParallelPPOActor.__init__
    sys.modules.pop("shardscale.verl.auto", None)  # verl's import below is the one that installs
    try:
        import_external_libs("shardscale.verl.auto")  # what init_model does first
        actor, _ = _actor(model_dir, dtype="bfloat16")
        ref = DataParallelPPOActor(config=actor.config, actor_module=actor.actor_module)
        out: dict[str, Any] = {
            "using": is_using_shardscale(actor),
            "ref_using": is_using_shardscale(ref),
            "loss_scaling": actor.scaler.loss_scaling,
        }
        out["rows"] = _train(actor, range(4))
    finally:
        DataParallelPPOActor.__init__ = original  # this worker runs other cases after this one
    return out


def _bad_input_case(workdir: str) -> dict[str, Any]:
    """Every refusal of use_shardscale(actor), and that a refusal leaves the actor as verl built it."""
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    from shardscale.core import ShardedGradScaler
    from shardscale.verl import (
        TESTED_VERL_LEGACY,
        VerlContractError,
        contract_problems,
        engine_state,
        is_using_shardscale,
        use_shardscale,
    )

    model_dir = os.path.join(workdir, "model")
    _write_model(model_dir)
    actor, manager = _actor(model_dir)
    _, other_manager = _actor(model_dir)
    verl_scaler = actor.scaler
    errors: dict[str, str | None] = {}

    def expect(name: str, exc: type[Exception], call: Any) -> None:
        try:
            call()
        except exc as e:
            errors[name] = str(e)
        else:
            errors[name] = None

    expect("not_an_actor", TypeError, lambda: use_shardscale(object()))
    expect("torch_scaler", TypeError, lambda: use_shardscale(actor, scaler=verl_scaler))
    both = ShardedGradScaler("cpu")
    expect("both", ValueError, lambda: use_shardscale(actor, scaler=both, init_scale=2.0))
    expect("disabled", ValueError, lambda: use_shardscale(actor, enabled=False))
    expect("not_a_manager", TypeError, lambda: use_shardscale(actor, checkpoint_manager=object()))
    expect(
        "other_manager", ValueError, lambda: use_shardscale(actor, checkpoint_manager=other_manager)
    )
    reference = DataParallelPPOActor(config=actor.config, actor_module=actor.actor_module)
    expect("reference_policy", RuntimeError, lambda: use_shardscale(reference))
    saved_version = verl.__version__
    verl.__version__ = "0.8.0"  # a release neither path supports
    try:
        expect("wrong_version", VerlContractError, lambda: use_shardscale(actor))
    finally:
        verl.__version__ = saved_version
    untouched = (
        actor.scaler is verl_scaler
        and not is_using_shardscale(actor)
        and not set(actor.__dict__) & {"_optimizer_step", "update_policy"}
        and not set(vars(manager)) & {"save_checkpoint", "load_checkpoint"}
        and not set(vars(other_manager)) & {"save_checkpoint", "load_checkpoint"}
    )
    scaler = use_shardscale(actor, checkpoint_manager=manager, init_scale=8.0)
    again = use_shardscale(actor) is scaler
    expect("again_with_options", RuntimeError, lambda: use_shardscale(actor, init_scale=2.0))
    state = engine_state(actor)
    before = state.state_dict()
    expect(
        "bad_counter", ValueError, lambda: state.load_state_dict({**before, "skipped_steps": -1})
    )
    return {
        "errors": errors,
        "untouched": untouched,
        "again": again,
        "state_unchanged": state.state_dict() == before,
        "scale": scaler.get_scale(),
        "contract": contract_problems(actor),
        "versions": (TESTED_VERL_LEGACY, verl.__version__),
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


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def runs(pool2: Pool, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    workdir = str(tmp_path_factory.mktemp("verl07"))
    kinds = ("shardscale", "shardscale-fsdp1", "torch", "shipped")
    return {kind: pool2.run(_case, kind, workdir) for kind in kinds}


@pytest.mark.parametrize("run", ["shardscale", "shardscale-fsdp1"])
def test_shardscale_skips_on_every_rank_and_matches_the_hand_loop(
    runs: dict[str, Any], run: str
) -> None:
    results = runs[run]
    ref = runs["shardscale"][0]["reference"]
    for res in results:  # the actor starts from the reference's weights, in its order
        assert _equal(res["initial"], ref["initial"])
    assert results[0]["verl_scaler"] == "ShardedGradScaler"  # verl made one (fp16) ...
    assert results[0]["scaler"].startswith("shardscale.")  # ... and use_shardscale replaced it
    skipped = [1.0 if s in INJECT else 0.0 for s in range(STEPS)]
    expected_scale = [INIT_SCALE * 0.5 ** sum(1 for k in INJECT if k < s) for s in range(STEPS)]
    for res in results:
        rows = res["rows"]
        # Both ranks skip exactly the injected step, and verl's metrics say so (one value
        # per optimizer step, beside actor/grad_norm's).
        assert [r["metrics"]["actor/step_skipped"] for r in rows] == [[s] for s in skipped]
        assert [r["metrics"]["actor/loss_scale"] for r in rows] == [[s] for s in expected_scale]
        assert [r["scale_before"] for r in rows] == expected_scale
        # The logged grad norm is the true global norm (not finite on the skipped step).
        for r, want in zip(rows, ref["norms"], strict=True):
            (got,) = r["metrics"]["actor/grad_norm"]
            if math.isinf(want):
                assert not math.isfinite(got)
            else:
                assert got == pytest.approx(want, rel=PARITY_RTOL), (got, want)
        # The skipped step left every parameter as it was, on this rank's shards too.
        for s in INJECT:
            assert _equal(rows[s]["params"], rows[s - 1]["params"])
    assert all(n > CLIP for n in ref["norms"])  # the clip acts on every taken step
    # The two ranks hold the same model, and it is the hand loop's within fp16's reach.
    start = ref["initial"]
    for step in range(STEPS):
        assert _equal(results[0]["rows"][step]["params"], results[1]["rows"][step]["params"])
        if step not in INJECT:
            moved = _moved(results[0]["rows"][step]["params"], start, ref["params"][step])
            assert moved < PARITY_RTOL, (step, moved)


@pytest.mark.parametrize("run", ["shardscale", "shardscale-fsdp1"])
def test_shardscale_checkpoint_resumes_exactly(runs: dict[str, Any], run: str) -> None:
    results = runs[run]
    saved_scale = INIT_SCALE * 0.5 ** sum(1 for k in INJECT if k < SAVE_AFTER)
    for res in results:
        # verl's own files, plus one per rank for the scaler.
        assert {"shardscale_world_size_2_rank_0.pt", "shardscale_world_size_2_rank_1.pt"} <= set(
            res["files"]
        )
        assert "model_world_size_2_rank_0.pt" in res["files"]
        assert res["loaded"]["scale"] == saved_scale
        assert _equal(res["loaded"]["params"], res["rows"][SAVE_AFTER - 1]["params"])
        # The resumed steps are the uninterrupted run's, bit for bit.
        assert [r["metrics"] for r in res["resumed"]] == [
            r["metrics"] for r in res["rows"][SAVE_AFTER:]
        ]
        assert _equal(res["resumed"][-1]["params"], res["rows"][-1]["params"])


def test_torch_scaler_in_the_same_actor_shows_what_use_shardscale_fixes(
    runs: dict[str, Any],
) -> None:
    """verl's own recipe with torch's scaler on the CPU: this passing means the gaps reproduce."""
    results = runs["torch"]
    ours = runs["shardscale"]
    for res, mine in zip(results, ours, strict=True):
        rows = res["rows"]
        # torch's scaler does skip the overflow on both ranks (its scale backs off) ...
        assert [r["scale_after"] for r in rows][2] == INIT_SCALE / 2
        assert _equal(rows[2]["params"], rows[1]["params"])
        # ... and verl's clip logs the same global norm (FSDP2's DTensor norm) ...
        for r, m in zip(rows, mine["rows"], strict=True):
            (got,), (want,) = r["metrics"]["actor/grad_norm"], m["metrics"]["actor/grad_norm"]
            if math.isfinite(want):
                assert got == pytest.approx(want, rel=NORM_RTOL), (got, want)
            else:
                assert not math.isfinite(got)
        # ... but nothing in verl's metrics says a step was skipped or what the scale is.
        assert all(not {"actor/loss_scale", "actor/step_skipped"} & set(r["metrics"]) for r in rows)
        # The scale is not in verl's checkpoint: a resumed run starts again at 65536.
        assert not any(f.startswith("shardscale_") for f in res["files"])
        assert res["loaded"]["scale"] == 2.0**16
        res["resumed_scales"] = [r["scale_before"] for r in res["resumed"]]
        assert res["resumed_scales"][0] == 2.0**16 != mine["resumed"][0]["scale_before"]
    for step in range(STEPS):
        assert _equal(results[0]["rows"][step]["params"], results[1]["rows"][step]["params"])


def test_verl_as_shipped_runs_fp16_unscaled_on_a_cpu(runs: dict[str, Any]) -> None:
    """verl's own ``ShardedGradScaler(growth_interval=400)`` is made for "cuda": here it is off."""
    for res in runs["shipped"]:
        assert res["verl_scaler"] == "ShardedGradScaler"
        assert res["verl_scaler_enabled"] is False
        assert res["scaler"].startswith("torch.")
        rows = res["rows"]
        assert all(r["scale_before"] == 1.0 for r in rows)  # no loss scaling at all
        assert all(not {"actor/loss_scale", "actor/step_skipped"} & set(r["metrics"]) for r in rows)
        (norm,) = rows[2]["metrics"]["actor/grad_norm"]
        assert not math.isfinite(norm)
        # A disabled scaler's step is optimizer.step(): the injected step is taken with the
        # non-finite gradients, clipped by a nan coefficient, and the model is lost.
        assert all(bool(torch.isfinite(p).all()) for p in rows[1]["params"])
        assert not any(bool(torch.isfinite(p).all()) for p in rows[2]["params"])


def test_config_key_gives_a_bf16_actor_the_guard(
    pool2: Pool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``model.external_lib=shardscale.verl.auto``: the actor verl builds next gets the line."""
    results = pool2.run(_auto_case, str(tmp_path_factory.mktemp("auto")))
    for res in results:
        assert res["using"] and not res["ref_using"]  # the reference policy is left alone
        assert res["loss_scaling"] is False  # bf16: no scaling, the guard only
        rows = res["rows"]
        assert [r["metrics"]["actor/step_skipped"] for r in rows] == [[0.0], [0.0], [1.0], [0.0]]
        assert [r["metrics"]["actor/loss_scale"] for r in rows] == [[1.0]] * 4
        assert not math.isfinite(rows[2]["metrics"]["actor/grad_norm"][0])
        assert _equal(rows[2]["params"], rows[1]["params"])
        assert all(bool(torch.isfinite(p).all()) for p in rows[-1]["params"])
    for a, b in zip(results[0]["rows"], results[1]["rows"], strict=True):
        assert _equal(a["params"], b["params"])


def test_bad_input_is_refused_and_changes_nothing(
    pool2: Pool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    for res in pool2.run(_bad_input_case, str(tmp_path_factory.mktemp("bad"))):
        errors = res["errors"]
        assert "legacy actor" in errors["not_an_actor"]
        assert "shardscale.core.ShardedGradScaler" in errors["torch_scaler"]
        assert "not both" in errors["both"]
        assert "enabled=False" in errors["disabled"]
        assert "FSDPCheckpointManager" in errors["not_a_manager"]
        assert "another optimizer" in errors["other_manager"]
        assert "reference policy" in errors["reference_policy"]
        # A release outside both supported series is refused by name, with both named.
        wrong = errors["wrong_version"]
        assert wrong is not None and "0.8.0" in wrong
        assert "verl 0.7 (tested 0.7.1)" in wrong and "verl 0.9 (tested 0.9.1)" in wrong
        assert "already applied" in errors["again_with_options"]
        assert "skipped_steps" in errors["bad_counter"]
        assert res["untouched"] and res["again"] and res["state_unchanged"]
        assert res["scale"] == 8.0
        # The installed verl is the tested one, and has everything use_shardscale relies on.
        assert res["contract"] == []
        assert res["versions"][0] == res["versions"][1]
