"""use_shardscale on verl's FSDP engine (verl 0.9.1, FSDP2), 2 gloo ranks, an overflow on one rank.

Everything here is verl's own code: ``FSDPEngineWithLMHead`` built from verl's
config classes around a tiny Qwen2 written to disk from a config (no download,
no tokenizer), trained with ``engine.train_batch`` and verl's ``sft_loss``,
the scheduler stepped with ``engine.lr_scheduler_step`` and checkpoints made
with ``engine.save_checkpoint``/``load_checkpoint``, as verl's
``TrainingWorker`` does (one mini-batch per RL step). The additions are what
verl needs to run on a CPU (see ``_cpu_platform``): a CPU platform registered
through verl's own ``PlatformRegistry``, ``attn_implementation="sdpa"`` and
``strategy="fsdp2"``. verl's ``save_checkpoint`` moves a CPU module "to the
GPU" (``module.to("cpu")`` here, which swaps every DTensor parameter) and is
run as it is.

"shardscale" runs apply ``use_shardscale(engine)``; "torch" runs give the same
engine torch's ``ShardedGradScaler`` on the CPU device, which is what verl
builds (its own is created without a device, defaults to "cuda" and disables
itself here). Both are compared with a hand-written torch loop that holds the
learning rate on the skipped step and clips the true global norm once.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import subprocess
import sys
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool

verl = pytest.importorskip(
    "verl", reason="verl is installed only by `nox -s verl` (verl 0.9 pins transformers<5.11)"
)
if not verl.__version__.startswith("0.9."):
    pytest.skip(
        f"verl 0.9's FSDP engine; verl {verl.__version__} is installed (`nox -s verl`)",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

STEPS = 6
INJECT = {2: 1}  # step -> the one rank whose loss is inf at that step
SAVE_AFTER = 4  # the checkpoint is written after this many steps
INIT_SCALE = 1024.0
CLIP = 0.5
LR = 0.5
WARMUP = 4  # verl's constant schedule with warmup: lr = LR * min(1, t / WARMUP) after t steps
VOCAB, SEQ, PROMPT, PER_RANK, MICRO = 64, 12, 4, 4, 2
U16 = torch.finfo(torch.float16).eps / 2  # fp16 unit roundoff, 2**-11
# The engine and the reference both run the model's forward and backward in fp16, in another
# order (2 ranks x 2 micro-batches, FSDP's reduce-scatter in fp32, vs one process): each gradient
# carries about 16 fp16 roundings of its own (2 layers, each attention + MLP + norm, forward and
# backward), and the two runs differ by at most the sum, 32 u, in the norms compared here.
PARITY_RTOL = 32 * U16


@pytest.fixture(scope="module")
def pool2() -> Any:
    pool = Pool(2, case_timeout=420.0)
    try:
        yield pool
    finally:
        pool.close()


# -- what verl needs on a CPU ------------------------------------------------------------------


def _cpu_platform() -> None:
    """Register and select a CPU platform through verl's own PlatformRegistry (once per process).

    verl ships CUDA/NPU/ROCm platforms only; without one it falls back to "nvidia" and the
    engine calls torch.cuda.set_device. This must run before verl's engine module is imported.
    """
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform

    if PlatformRegistry.get("cpu") is not None:
        return

    class PlatformCPU(PlatformBase):  # type: ignore[misc]
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: torch.cpu)  # verl's own CPU checks compare to it

        def is_available(self) -> bool:
            return False  # no accelerator: verl's checkpoints keep the CPU RNG state only

        def current_device(self) -> str:
            return "cpu"  # verl moves tensors with .to(current_device())

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str) -> Any:
            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    PlatformRegistry.register("cpu")(PlatformCPU)
    set_platform(PlatformCPU())


def _write_model(model_dir: str) -> None:
    """A tiny Qwen2 from a config, saved by rank 0 (the engine loads it with from_pretrained)."""
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


def _engine(
    model_dir: str, dtype: str = "fp16", external_lib: str | None = None, *, initialize: bool = True
) -> Any:
    _cpu_platform()
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    model = HFModelConfig(
        path=model_dir, load_tokenizer=False, use_remove_padding=False,
        override_config={"attn_implementation": "sdpa"},
        external_lib=external_lib,
    )  # fmt: skip
    engine = FSDPEngineWithLMHead(
        model,
        FSDPEngineConfig(
            strategy="fsdp2",
            forward_only=False,
            use_torch_compile=False,
            mixed_precision={"param_dtype": dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        ),
        FSDPOptimizerConfig(
            optimizer="SGD",
            lr=LR,
            weight_decay=0.0,
            clip_grad=CLIP,
            total_training_steps=100,
            lr_warmup_steps=WARMUP,
        ),
        CheckpointConfig(),
    )
    if initialize:
        engine.initialize()
    return engine


# -- the data and the loss -----------------------------------------------------------------------


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s fixed batch: token ids and the loss mask (the response part)."""
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=g)
    mask = torch.zeros(PER_RANK, SEQ, dtype=torch.long)
    mask[:, PROMPT:] = 1
    return ids, mask


def _tensordict(rank: int) -> Any:
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    ids, mask = _batch(rank)

    def nested(t: torch.Tensor) -> torch.Tensor:
        return torch.nested.as_nested_tensor(list(t), layout=torch.jagged)

    positions = torch.arange(SEQ).expand(PER_RANK, SEQ).contiguous()
    td = TensorDict(
        {"input_ids": nested(ids), "position_ids": nested(positions), "loss_mask": nested(mask)},
        batch_size=[PER_RANK],
    )
    # What verl's TrainingWorker.train_batch assigns from its config before the engine runs.
    tu.assign_non_tensor(
        td, use_remove_padding=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=MICRO,
        use_fused_kernels=False, temperature=1.0, max_token_len_per_gpu=1000,
    )  # fmt: skip
    return td


def _loss(inject: list[bool], model_output: Any, data: Any, dp_group: Any = None) -> Any:
    """verl's sft_loss, times inf on this rank when ``inject[0]`` is set."""
    from verl.workers.utils.losses import sft_loss

    loss, metrics = sft_loss(None, model_output, data, dp_group)
    if inject[0]:
        loss = loss * math.inf
    return loss, metrics


def _full_params(engine: Any) -> list[torch.Tensor]:
    out = []
    for p in engine.module.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(full.detach().to(torch.float32).clone())
    return out


def _train(engine: Any, steps: range) -> list[dict[str, Any]]:
    rank = dist.get_rank()
    td = _tensordict(rank)
    inject = [False]
    loss_fn = partial(_loss, inject)
    rows = []
    with engine.train_mode():
        for step in steps:
            inject[0] = INJECT.get(step) == rank
            scale = engine.scaler.get_scale()
            out = engine.train_batch(td.clone(), loss_function=loss_fn)
            lr = engine.lr_scheduler_step()
            metrics = {k: v for k, v in out["metrics"].items() if not isinstance(v, list)}
            rows.append({"metrics": metrics, "scale_before": scale,
                         "scale_after": engine.scaler.get_scale(), "lr": lr,
                         "sched": engine.lr_scheduler.last_epoch})  # fmt: skip
    return rows


# -- the hand-written torch loop -------------------------------------------------------------------


def _reference(model_dir: str) -> dict[str, Any]:
    """The run the engine must match: the same model, data and loss in one process, by hand.

    Each step: the fp16 model's gradient of every rank's sft loss (normalized by the global
    token count, as verl's loss with FSDP's averaging over 2 ranks is), unscaled, the true
    global norm, one clip, SGD. The injected step is skipped: no update, the scale halves, the
    learning rate holds (the schedule counts the steps that updated the policy).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="sdpa"
    )
    batches = [_batch(r) for r in range(2)]
    tokens = sum(int(m.sum()) for _, m in batches)
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
        half = copy.deepcopy(model).half()
        for ids, mask in batches:
            for i in range(0, PER_RANK, MICRO):
                x, m = ids[i : i + MICRO], mask[i : i + MICRO]
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = half(input_ids=x, attention_mask=torch.ones_like(x)).logits
                logp = torch.log_softmax(logits.float()[:, :-1], dim=-1)
                picked = logp.gather(-1, x[:, 1:, None])[..., 0]
                loss = -(picked * m[:, 1:]).sum() / tokens
                (loss * scale).backward()
        grads = [p.grad.to(torch.float64) / scale for p in half.parameters()]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        coef = min(1.0, CLIP / (norm + 1e-6))
        lr = LR * min(1.0, taken / WARMUP)
        with torch.no_grad():
            for param, g in zip(model.parameters(), grads, strict=True):
                param.sub_((lr * coef * g).to(torch.float32))
        taken += 1
        norms.append(norm)
        params.append([p.detach().clone() for p in model.parameters()])
    return {"norms": norms, "params": params, "initial": initial}


# -- the cases (run on every rank) ---------------------------------------------------------------


def _case(kind: str, workdir: str) -> dict[str, Any]:
    model_dir = os.path.join(workdir, "model")
    ckpt = os.path.join(workdir, f"ckpt-{kind}")
    _write_model(model_dir)
    engine = _engine(model_dir)
    out: dict[str, Any] = {"verl_scaler": type(engine.scaler).__name__}
    if kind == "shardscale":
        from shardscale.verl import use_shardscale

        use_shardscale(engine, init_scale=INIT_SCALE)
    else:  # what verl builds, on the device it runs on
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        engine.scaler = ShardedGradScaler("cpu", init_scale=INIT_SCALE, growth_interval=400)
    out["scaler"] = type(engine.scaler).__module__
    rows = _train(engine, range(SAVE_AFTER))
    out["params_at_save"] = _full_params(engine)
    engine.save_checkpoint(ckpt, global_step=SAVE_AFTER)
    out["files"] = sorted(os.listdir(ckpt))
    rows += _train(engine, range(SAVE_AFTER, STEPS))
    out["rows"] = rows
    out["params"] = _full_params(engine)
    # Resume: a fresh engine, as verl builds it on restart, then the checkpoint.
    engine2 = _engine(model_dir)
    if kind == "shardscale":
        from shardscale.verl import use_shardscale

        use_shardscale(engine2)  # verl's default initial scale; the checkpoint's must win
    else:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        engine2.scaler = ShardedGradScaler("cpu", growth_interval=400)  # verl's, on the CPU
    engine2.load_checkpoint(ckpt)
    out["loaded"] = {"scale": engine2.scaler.get_scale(), "sched": engine2.lr_scheduler.last_epoch}
    out["loaded_params"] = _full_params(engine2)
    out["resumed"] = _train(engine2, range(SAVE_AFTER, STEPS))
    out["resumed_params"] = _full_params(engine2)
    if dist.get_rank() == 0:
        out["reference"] = _reference(model_dir)
    return out


def _auto_bf16_case(workdir: str) -> dict[str, Any]:
    """A bf16 engine whose model config names ``external_lib=shardscale.verl.auto``."""
    from shardscale.verl import is_using_shardscale

    model_dir = os.path.join(workdir, "model")
    _write_model(model_dir)
    _cpu_platform()
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    original = FSDPEngine.initialize
    sys.modules.pop("shardscale.verl.auto", None)  # verl's import below is the one that installs
    try:
        engine = _engine(model_dir, dtype="bf16", external_lib="shardscale.verl.auto")
        out: dict[str, Any] = {
            "using": is_using_shardscale(engine),
            "loss_scaling": engine.scaler.loss_scaling,
        }
        out["rows"] = _train(engine, range(4))
        out["params"] = _full_params(engine)
    finally:
        FSDPEngine.initialize = original  # this worker runs other cases after this one
    return out


def _bad_input_case(workdir: str) -> dict[str, Any]:
    """Every refusal of use_shardscale, and that a refusal leaves the engine as verl built it."""
    import verl

    from shardscale.core import ShardedGradScaler
    from shardscale.verl import (
        TESTED_VERL,
        contract_problems,
        engine_state,
        is_using_shardscale,
        use_shardscale,
    )

    model_dir = os.path.join(workdir, "model")
    _write_model(model_dir)
    engine = _engine(model_dir)
    verl_scaler = engine.scaler
    errors: dict[str, str | None] = {}

    def expect(name: str, exc: type[Exception], call: Any) -> None:
        try:
            call()
        except exc as e:
            errors[name] = str(e)
        else:
            errors[name] = None

    expect("not_an_engine", TypeError, lambda: use_shardscale(object()))
    expect("torch_scaler", TypeError, lambda: use_shardscale(engine, scaler=verl_scaler))
    both = ShardedGradScaler("cpu")
    expect("both", ValueError, lambda: use_shardscale(engine, scaler=both, init_scale=2.0))
    expect("disabled", ValueError, lambda: use_shardscale(engine, enabled=False))
    untouched = (
        engine.scaler is verl_scaler
        and not is_using_shardscale(engine)
        and not set(engine.__dict__) & {"optimizer_step", "train_batch", "lr_scheduler_step"}
    )
    expect(
        "uninitialized", RuntimeError, lambda: use_shardscale(_engine(model_dir, initialize=False))
    )
    scaler = use_shardscale(engine, init_scale=8.0)
    again = use_shardscale(engine) is scaler
    expect("again_with_options", RuntimeError, lambda: use_shardscale(engine, init_scale=2.0))
    state = engine_state(engine)
    before = state.state_dict()
    expect(
        "bad_counter", ValueError, lambda: state.load_state_dict({**before, "skipped_steps": -1})
    )
    bad_scaler = {**before, "scaler": {**before["scaler"], "scale": -1.0}}
    expect("bad_scaler", ValueError, lambda: state.load_state_dict(bad_scaler))
    return {
        "errors": errors,
        "untouched": untouched,
        "again": again,
        "state_unchanged": state.state_dict() == before,
        "scale": scaler.get_scale(),
        "contract": contract_problems(engine),
        "versions": (TESTED_VERL, verl.__version__),
    }


def _save_after_a_step(workdir: str) -> str | None:
    """verl's own save_checkpoint (with its module move) after one shardscale step."""
    from shardscale.verl import use_shardscale

    model_dir = os.path.join(workdir, "model")
    _write_model(model_dir)
    engine = _engine(model_dir)
    use_shardscale(engine, init_scale=INIT_SCALE)
    _train(engine, range(1))
    try:
        engine.save_checkpoint(os.path.join(workdir, "ckpt-moved"), global_step=1)
    except RuntimeError as exc:
        return str(exc)
    return None


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


@pytest.fixture(scope="module")
def runs(pool2: Pool, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    workdir = str(tmp_path_factory.mktemp("verl"))
    return {kind: pool2.run(_case, kind, workdir) for kind in ("shardscale", "torch")}


def test_shardscale_skips_on_every_rank_and_matches_the_hand_loop(runs: dict[str, Any]) -> None:
    results = runs["shardscale"]
    ref = results[0]["reference"]
    for res in results:
        rows = res["rows"]
        # Both ranks skip exactly the injected step, and verl's metrics say so.
        assert [r["metrics"]["step_skipped"] for r in rows] == [
            1.0 if s in INJECT else 0.0 for s in range(STEPS)
        ]
        expected = [INIT_SCALE * 0.5 ** sum(1 for k in INJECT if k < s) for s in range(STEPS)]
        assert [r["metrics"]["loss_scale"] for r in rows] == expected
        assert [r["scale_before"] for r in rows] == expected
        # The scheduler held on the skipped step: it counts taken steps only.
        taken = [sum(1 for k in range(s + 1) if k not in INJECT) for s in range(STEPS)]
        assert [r["sched"] for r in rows] == taken
        # The logged grad_norm is the true global norm (inf on the skipped step).
        for r, want in zip(rows, ref["norms"], strict=True):
            got = r["metrics"]["grad_norm"]
            if math.isinf(want):
                assert not math.isfinite(got)
            else:
                assert got == pytest.approx(want, rel=PARITY_RTOL), (got, want)
    assert all(n > CLIP for n in ref["norms"])  # the clip acts on every taken step
    # Parameters bit-identical across ranks, and the hand loop's within fp16's reach.
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)
    start = ref["initial"]
    assert _moved(results[0]["params"], start, ref["params"][-1]) < PARITY_RTOL
    assert results[0]["verl_scaler"] == "ShardedGradScaler"  # verl made one (fp16) ...
    assert results[0]["scaler"].startswith("shardscale.")  # ... and use_shardscale replaced it


def test_shardscale_checkpoint_resumes_exactly(runs: dict[str, Any]) -> None:
    results = runs["shardscale"]
    saved_scale = INIT_SCALE * 0.5 ** sum(1 for k in INJECT if k < SAVE_AFTER)
    for res in results:
        assert "shardscale_world_size_2_rank_0.pt" in res["files"]
        assert "shardscale_world_size_2_rank_1.pt" in res["files"]
        taken = sum(1 for k in range(SAVE_AFTER) if k not in INJECT)
        assert res["loaded"] == {"scale": saved_scale, "sched": taken}
        assert all(
            torch.equal(a, b)
            for a, b in zip(res["loaded_params"], res["params_at_save"], strict=True)
        )
        # The resumed steps are the uninterrupted run's, bit for bit.
        assert [r["metrics"] for r in res["resumed"]] == [
            r["metrics"] for r in res["rows"][SAVE_AFTER:]
        ]
        assert all(
            torch.equal(a, b) for a, b in zip(res["resumed_params"], res["params"], strict=True)
        )


def test_torch_scaler_in_the_same_engine_shows_what_use_shardscale_fixes(
    runs: dict[str, Any],
) -> None:
    """verl's own recipe with torch's scaler on the CPU: this passing means the gaps reproduce."""
    results = runs["torch"]
    ref = runs["shardscale"][0]["reference"]
    for res in results:
        rows = res["rows"]
        # torch's scaler does skip the overflow on both ranks (its scale backs off) ...
        assert [r["scale_after"] for r in rows][2] == INIT_SCALE / 2
        # ... but nothing in verl's metrics says so, and the scheduler advanced on it.
        assert all(set(r["metrics"]) == {"grad_norm"} for r in rows)
        assert [r["sched"] for r in rows] == list(range(1, STEPS + 1))
        # The scale is not in verl's checkpoint: a resumed run starts from verl's 65536.
        assert not any(f.startswith("shardscale_") for f in res["files"])
        assert res["loaded"]["scale"] == 2.0**16
        # ... and at that scale this model's fp16 gradients overflow: the resumed steps skip.
        assert not any(math.isfinite(r["metrics"]["grad_norm"]) for r in res["resumed"])
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)
    # The advanced schedule moved the weights away from the run that held it.
    start = ref["initial"]
    assert _moved(results[0]["params"], start, ref["params"][-1]) > 4 * PARITY_RTOL


def test_config_key_gives_a_bf16_engine_the_guard(
    pool2: Pool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``model.external_lib=shardscale.verl.auto``: the engine verl builds gets the line."""
    results = pool2.run(_auto_bf16_case, str(tmp_path_factory.mktemp("auto")))
    for res in results:
        assert res["using"] and res["loss_scaling"] is False  # bf16: no scaling, the guard only
        rows = res["rows"]
        assert [r["metrics"]["step_skipped"] for r in rows] == [0.0, 0.0, 1.0, 0.0]
        assert [r["metrics"]["loss_scale"] for r in rows] == [1.0] * 4
        assert [r["sched"] for r in rows] == [1, 2, 2, 3]  # held on the skipped step
        assert not math.isfinite(rows[2]["metrics"]["grad_norm"])
        assert all(math.isfinite(r["metrics"]["grad_norm"]) for i, r in enumerate(rows) if i != 2)
        assert all(bool(torch.isfinite(p).all()) for p in res["params"])
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)


def test_bad_input_is_refused_and_changes_nothing(
    pool2: Pool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    for res in pool2.run(_bad_input_case, str(tmp_path_factory.mktemp("bad"))):
        errors = res["errors"]
        assert "verl's FSDP engine" in errors["not_an_engine"]
        assert "shardscale.core.ShardedGradScaler" in errors["torch_scaler"]
        assert "not both" in errors["both"]
        assert "enabled=False" in errors["disabled"]
        assert "engine.initialize()" in errors["uninitialized"]
        assert "already applied" in errors["again_with_options"]
        assert "skipped_steps" in errors["bad_counter"]
        assert errors["bad_scaler"] is not None and "scale" in errors["bad_scaler"]
        assert res["untouched"] and res["again"] and res["state_unchanged"]
        assert res["scale"] == 8.0
        # The installed verl is the tested one, and has everything use_shardscale relies on.
        assert res["contract"] == []
        assert res["versions"][0] == res["versions"][1]


def test_listed_by_the_registry_without_importing_verl() -> None:
    code = (
        "import json, sys\n"
        "from shardscale.core import get_registry\n"
        "info = [p for p in get_registry().plugins() if p.name == 'verl']\n"
        "print(json.dumps({'info': [[i.distribution, list(i.hooks)] for i in info],"
        " 'imported': 'verl' in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"info": [["shardscale-verl", []]], "imported": False}


def test_save_checkpoint_moves_the_module_after_a_step(
    pool2: Pool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    errors = pool2.run(_save_after_a_step, str(tmp_path_factory.mktemp("moved")))
    assert errors == [None, None], errors
