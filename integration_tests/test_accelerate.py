"""A real ``Accelerator`` training loop on 2 gloo ranks with ``use_shardscale``, overflow on one rank.

Accelerate's path exercised on CPU: ``MULTI_CPU`` (DDP over gloo). Its FSDP
path (``fsdp_plugin``) is only taken on GPU-like devices (``MULTI_GPU`` etc.;
``cpu=True`` ignores the plugin), so FSDP2 is not exercised here.

On CPU Accelerate builds no scaler at all (fp16 autocast is GPU-only there),
so the loop runs in float32 with the scaler active: the scaling, skip,
clipping and checkpoint logic is what is tested. "torch" runs set
``accelerator.scaler = torch.amp.GradScaler("cpu")``, which is what Accelerate
builds on a GPU (``get_grad_scaler``), to show what ``use_shardscale`` fixes:
with a fused AdamW, an overflow step is skipped inside the kernel but
``optimizer_step_was_skipped`` stays False and the scheduler advances
(accelerate#4242).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool
from scaler_support import torch_steps
from tolerances import clipped_grad_rtol, norm_rtol

pytest.importorskip("accelerate")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

STEPS = 8
INJECT = {2: 0, 5: 1}  # step -> the one rank whose loss is inf there
INIT_SCALE = 1024.0
CLIP = 0.05
DIM = 8


def _fresh_accelerator(mixed_precision: str = "fp16", **kwargs: Any) -> Any:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    # Accelerate keeps process-wide singletons; each case starts from none.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        {"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world),
         "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29556"}
    )  # fmt: skip
    return Accelerator(cpu=True, mixed_precision=mixed_precision, **kwargs)


def _setup(kind: str, fused: bool, init_scale: float) -> tuple[Any, Any, Any, Any]:
    from shardscale.accelerate import use_shardscale

    acc = _fresh_accelerator()
    assert acc.distributed_type.name == "MULTI_CPU" and acc.scaler is None
    if kind == "shardscale":
        use_shardscale(acc, init_scale=init_scale)
    else:  # what Accelerate builds on a GPU
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    torch.manual_seed(0)  # identical initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def _norm(grads: list[torch.Tensor]) -> float:
    return float(torch.nn.utils.get_total_norm([g.to(torch.float64) for g in grads], 2.0))


def _train(acc: Any, model: Any, opt: Any, sched: Any, steps: range, clip: bool) -> list[Any]:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    batches = [torch.randn(8, DIM, generator=g) for _ in range(steps.stop)]
    rows = []
    for step in steps:
        loss = (model(batches[step]) - 1.0).pow(2).mean()
        if INJECT.get(step) == rank:
            loss = loss * math.inf
        acc.backward(loss)
        scale = acc.scaler.get_scale()
        grads = [p.grad for p in model.parameters()]
        row: dict[str, Any] = {"ref_norm": _norm(grads) / scale, "scale_before": scale}
        if clip:
            row["norm"] = float(acc.clip_grad_norm_(model.parameters(), CLIP))
            row["after_clip"] = _norm([p.grad for p in model.parameters()])
        opt.step()
        sched.step()
        opt.zero_grad()
        row.update(
            skipped=acc.optimizer_step_was_skipped, scale=acc.scaler.get_scale(),
            lr=opt.param_groups[0]["lr"], sched=sched.scheduler.last_epoch,
        )  # fmt: skip
        rows.append(row)
    return rows


def _params(model: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _case(kind: str, fused: bool, ckpt: str | None) -> dict[str, Any]:
    from shardscale.accelerate import ShardscaleAcceleratedOptimizer

    acc, model, opt, sched = _setup(kind, fused, INIT_SCALE)
    out: dict[str, Any] = {"opt_class": type(opt).__name__}
    if kind == "shardscale":
        assert isinstance(opt, ShardscaleAcceleratedOptimizer)
    out["rows"] = _train(acc, model, opt, sched, range(STEPS), clip=kind == "shardscale")
    out["params"] = _params(model)
    if ckpt is None:
        return out
    acc.save_state(ckpt)
    # Accelerate writes scaler.pt on the main process only and does not wait: rank 1 would
    # otherwise read a file rank 0 may still be writing.
    acc.wait_for_everyone()
    out["saved_scaler"] = torch.load(Path(ckpt) / "scaler.pt", weights_only=True)
    # A fresh Accelerator and scaler built with another scale: the checkpoint's must win.
    acc2, model2, opt2, sched2 = _setup(kind, fused, 2.0**16)
    acc2.load_state(ckpt)
    out["loaded"] = {"scale": acc2.scaler.get_scale(), "sched": sched2.scheduler.last_epoch}
    out["loaded_params_equal"] = all(
        torch.equal(a, b) for a, b in zip(_params(model2), out["params"], strict=True)
    )
    out["resumed"] = _train(acc2, model2, opt2, sched2, range(STEPS, STEPS + 2), clip=True)
    out["resumed_params"] = _params(model2)
    return out


def _check_shardscale(results: list[dict[str, Any]], *, fused: bool) -> None:
    numel = sum(p.numel() for p in results[0]["params"])
    rtol = 4 * norm_rtol(numel, torch.float32, 2.0)  # ours and torch's, each within the bound
    for rank, res in enumerate(results):
        rows = res["rows"]
        assert res["opt_class"] == "ShardscaleAcceleratedOptimizer"
        # Every rank reports exactly the injected steps as skipped, fused optimizer included.
        assert [i for i, r in enumerate(rows) if r["skipped"]] == sorted(INJECT), (rank, rows)
        assert [r["scale"] for r in rows] == [
            INIT_SCALE * 0.5 ** sum(1 for k in INJECT if k <= i) for i in range(STEPS)
        ]
        # Accelerate's scheduler holds on skipped steps and otherwise steps once per process
        # (split_batches=False), so it stands at 2 * taken steps.
        taken = STEPS - len(INJECT)
        assert rows[-1]["sched"] == 2 * taken
        assert rows[-1]["lr"] == pytest.approx(1e-2 / (1.0 + 2 * taken), rel=1e-12)
        clean = [r for r in rows if not r["skipped"]]
        assert any(r["ref_norm"] > CLIP for r in clean)  # clipping really acts
        for r in clean:
            # clip_grad_norm_ returns the true global norm (DDP: every rank's grads are the mean).
            assert r["norm"] == pytest.approx(r["ref_norm"], rel=rtol), r
            if not fused:
                expected = r["ref_norm"] * min(1.0, CLIP / (r["ref_norm"] + 1e-6))
                tol = clipped_grad_rtol(numel, torch.float32, 2.0) + rtol
                assert r["after_clip"] == pytest.approx(expected, rel=tol), r
            else:
                # A fused optimizer's gradients stay scaled: it unscales and clips in its kernel.
                assert r["after_clip"] == pytest.approx(r["ref_norm"] * r["scale_before"], rel=rtol)
        for r in rows:
            if r["skipped"]:
                assert not math.isfinite(r["norm"])
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)


def _check_resume(results: list[dict[str, Any]]) -> None:
    final = INIT_SCALE * 0.5 ** len(INJECT)
    for res in results:
        assert res["saved_scaler"]["scale"] == final
        assert res["loaded"] == {"scale": final, "sched": 2 * (STEPS - len(INJECT))}
        assert res["loaded_params_equal"]
        assert [r["scale_before"] for r in res["resumed"]] == [final, final]
        assert not any(r["skipped"] for r in res["resumed"])
    for a, b in zip(results[0]["resumed_params"], results[1]["resumed_params"], strict=True):
        assert torch.equal(a, b)


def test_ddp_fused_adamw_skip_clip_and_checkpoint(pool2: Pool, tmp_path: Path) -> None:
    results = pool2.run(_case, "shardscale", True, str(tmp_path / "fused"))
    _check_shardscale(results, fused=True)
    _check_resume(results)


def test_ddp_unfused_adamw_skip_and_clip(pool2: Pool) -> None:
    results = pool2.run(_case, "shardscale", False, None)
    _check_shardscale(results, fused=False)


def test_torch_scaler_fused_adamw_reports_no_skip(pool2: Pool) -> None:
    """accelerate#4242 on CPU: the bug use_shardscale fixes (this passing means it reproduces)."""
    for res in pool2.run(_case, "torch", True, None):
        rows = res["rows"]
        assert res["opt_class"] == "AcceleratedOptimizer"
        # The scaler saw the overflows and backed off ...
        assert rows[-1]["scale"] == INIT_SCALE * 0.5 ** len(INJECT)
        # ... but Accelerate says no step was skipped, and the scheduler advanced on them.
        assert not any(r["skipped"] for r in rows)
        assert rows[-1]["sched"] == 2 * STEPS


# -- two optimizers, against a hand-written torch loop ------------------------------------------
#
# The user's loop: accelerator.backward, accelerator.clip_grad_norm_(model.parameters()) over both
# optimizers' parameters, then both steps. The reference is torch's recipe for several
# optimizers, in the same process on the same data: DDP (what Accelerate's MULTI_CPU prepares),
# unscale_ each, ONE clip_grad_norm_ of the true norm (DDP averaged the gradients), step each,
# ONE update.

LR = 0.1


def _two_optimizers(net: torch.nn.Module) -> list[torch.optim.Optimizer]:
    # The second one fused: it unscales inside its step from the scaler's grad_scale.
    return [
        torch.optim.SGD(net[0].parameters(), lr=LR),
        torch.optim.SGD(net[2].parameters(), lr=LR, fused=True),
    ]


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)  # identical initial weights on every rank and in both loops
    return torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own data
    return [torch.randn(8, DIM, generator=g) for _ in range(STEPS)]


def _step_loss(model: Any, x: torch.Tensor, step: int) -> torch.Tensor:
    loss = (model(x) - 1.0).pow(2).mean()
    return loss * math.inf if INJECT.get(step) == dist.get_rank() else loss


def _two_optimizer_case() -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from shardscale.accelerate import use_shardscale

    acc = _fresh_accelerator()
    use_shardscale(acc, init_scale=INIT_SCALE)
    net = _net()
    model, *opts = acc.prepare(net, *_two_optimizers(net))
    ours = []
    for step, x in enumerate(_batches()):
        acc.backward(_step_loss(model, x, step))
        norm = acc.clip_grad_norm_(model.parameters(), CLIP)
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()
        ours.append({"scale": acc.scaler.get_scale(), "norm": float(norm),
                     "flags": [opt.step_was_skipped for opt in opts],
                     "skipped": acc.optimizer_step_was_skipped})  # fmt: skip
    ref_net = _net()
    ref_model = DistributedDataParallel(ref_net)
    ref_opts = _two_optimizers(ref_net)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    ref = []
    for step, x in enumerate(_batches()):
        scaler.scale(_step_loss(ref_model, x, step)).backward()
        for opt in ref_opts:
            scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(ref_net.parameters(), CLIP)
        skipped = torch_steps(scaler, ref_opts)
        ref.append({"scale": scaler.get_scale(), "norm": float(norm), "skipped": skipped})
    return {"ours": ours, "torch": ref, "params": _params(net), "ref_params": _params(ref_net)}


def test_two_optimizers_match_torch(pool2: Pool) -> None:
    results = pool2.run(_two_optimizer_case)
    numel = sum(p.numel() for p in results[0]["params"])
    rtol = 4 * norm_rtol(numel, torch.float32, 2.0)  # ours and torch's, each within the bound
    # float32 throughout (no fp16 autocast on CPU): the loops differ only in the norm's rounding
    # and the clip coefficient's, clipped_grad_rtol; each step moves a weight by at most
    # lr * CLIP, the next gradient's sensitivity to the gap at most doubles it, so the weights
    # agree within 2 * STEPS * lr * CLIP * rtol. (The second optimizer unscaled twice moves its
    # weights lr * CLIP / scale instead of lr * CLIP: far outside.)
    atol = 2 * STEPS * LR * CLIP * clipped_grad_rtol(numel, torch.float32, 2.0)
    for rank, res in enumerate(results):
        ours, ref = res["ours"], res["torch"]
        # The same scale history as torch's: one backoff per overflowing step.
        assert [r["scale"] for r in ours] == [r["scale"] for r in ref], (rank, ours, ref)
        assert [i for i, r in enumerate(ref) if r["skipped"]] == sorted(INJECT)
        for o, t in zip(ours, ref, strict=True):
            assert o["skipped"] == t["skipped"] and o["flags"] == [t["skipped"]] * 2, (rank, o)
            if not t["skipped"]:
                assert t["norm"] > CLIP  # clipping acts
                assert o["norm"] == pytest.approx(t["norm"], rel=rtol)
        for a, b in zip(res["params"], res["ref_params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0.0, atol=atol)
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)


# -- plain-tensor expert parallelism through clip_grad_norm_ ------------------------------------
#
# No DDP (only the optimizers are prepared): `shared` sees the same batch on both ranks
# (identical gradients, counted once), `expert` is each rank's own, declared in distinct_params
# and stepped by its own optimizer. clip_grad_norm_ over both optimizers' parameters is the
# "clip with the scaler's configuration" path.


def _expert_case() -> list[dict[str, float]]:
    from shardscale.accelerate import use_shardscale
    from shardscale.core import Layout

    acc = _fresh_accelerator()
    torch.manual_seed(0)
    shared = torch.nn.Linear(DIM, 4)
    torch.manual_seed(10 + dist.get_rank())
    expert = torch.nn.Linear(DIM, 4)
    scaler = use_shardscale(
        acc, init_scale=INIT_SCALE, layout=Layout(distinct_params=expert.parameters())
    )
    opts = acc.prepare(
        torch.optim.SGD(shared.parameters(), lr=LR), torch.optim.SGD(expert.parameters(), lr=LR)
    )
    g = torch.Generator().manual_seed(7)
    mine = torch.Generator().manual_seed(100 + dist.get_rank())
    rows = []
    for _ in range(3):
        same, own = torch.randn(8, DIM, generator=g), torch.randn(8, DIM, generator=mine)
        acc.backward((shared(same) - 1).pow(2).mean() + (expert(own) - 1).pow(2).mean())

        def sq(module: torch.nn.Module) -> torch.Tensor:
            return sum(p.grad.double().pow(2).sum() for p in module.parameters())  # type: ignore[union-attr,return-value]

        experts = sq(expert)
        dist.all_reduce(experts)
        true = float((sq(shared) + experts).sqrt()) / scaler.get_scale()
        norm = acc.clip_grad_norm_([*shared.parameters(), *expert.parameters()], CLIP)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        rows.append({"true": true, "ours": float(norm)})
    return rows


def test_expert_parallel_plain_tensors_clip_by_the_true_norm(pool2: Pool) -> None:
    numel = 2 * (DIM * 4 + 4)
    for rows in pool2.run(_expert_case):
        assert len(rows) == 3
        for row in rows:
            # ours (float32 accumulation) against the float64 reference: one norm_rtol
            assert row["ours"] == pytest.approx(
                row["true"], rel=norm_rtol(numel, torch.float32, 2.0)
            )


# -- skip policies without loss scaling: bf16 + loss_scaling=False + spike + streak -------------
#
# The one option: use_shardscale(accelerator, loss_scaling=False, policies=[...]) on a bf16
# Accelerator (which builds no scaler of its own). A spike (the loss times 1e4 on rank 1: finite
# gradients far above the threshold) and a nan loss on rank 0 are injected at known steps;
# whether a step is a spike is decided here from torch's own norm (float64). Then two nan steps
# in a row reach SkipStreakLimit(max_skips=2): every rank raises at the same step.

SPIKE_STEP, NAN_STEP = 3, 5
SPIKE_ABS = 100.0  # far above this model's clean pre-clip norms (checked), far below 1e4 times


def _policy_case() -> dict[str, Any]:
    from shardscale.accelerate import use_shardscale
    from shardscale.core import SkipStreakError, SkipStreakLimit, SpikeSkip
    from shardscale.core.testing import HostReadRecorder

    acc = _fresh_accelerator("bf16")
    assert acc.scaler is None  # Accelerate's bf16: no scaler, no guard
    scaler = use_shardscale(
        acc,
        loss_scaling=False,
        policies=[SpikeSkip(max_norm_abs=SPIKE_ABS, z=None), SkipStreakLimit(max_skips=2)],
    )
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    model, opt, sched = acc.prepare(net, opt, sched)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    rows: list[dict[str, Any]] = []
    reads: list[list[str]] = []
    streak: dict[str, Any] = {}
    for step in range(STEPS + 2):
        loss = (model(torch.randn(8, DIM, generator=g)).float() - 1.0).pow(2).mean()
        if step == SPIKE_STEP and rank == 1:
            loss = loss * 1e4
        if (step == NAN_STEP and rank == 0) or step >= STEPS:  # then a streak of two
            loss = loss * math.nan
        acc.backward(loss)
        ref = _norm([p.grad for p in model.parameters()])
        acc.clip_grad_norm_(model.parameters(), CLIP)
        try:
            opt.step()
        except SkipStreakError as exc:
            streak = {"step": step, "streak": exc.streak, "reasons": [int(r) for r in exc.reasons]}
            break
        with HostReadRecorder() as asked:
            sched.step()  # held on a skipped step without reading the flag (deferred copy)
        reads.append(asked.seen)
        opt.zero_grad()
        rows.append({"ref_norm": ref, "skipped": acc.optimizer_step_was_skipped,
                     "reason": int(scaler.last_skip_reason), "scale": scaler.get_scale(),
                     "sched": sched.scheduler.last_epoch, "lr": opt.param_groups[0]["lr"]})  # fmt: skip
    return {"rows": rows[:STEPS], "streak": streak, "params": _params(net), "reads": reads}


def test_bf16_spike_nonfinite_and_streak_through_the_one_option(pool2: Pool) -> None:
    from shardscale.core import SkipReason

    expected = {SPIKE_STEP: SkipReason.SPIKE, NAN_STEP: SkipReason.NONFINITE}
    results = pool2.run(_policy_case)
    for rank, res in enumerate(results):
        rows = res["rows"]
        assert len(rows) == STEPS
        norms = [r["ref_norm"] for r in rows]
        assert norms[SPIKE_STEP] > SPIKE_ABS and math.isfinite(norms[SPIKE_STEP])
        assert all(n < SPIKE_ABS for i, n in enumerate(norms) if i not in expected)
        # Every rank skips exactly those steps, for that reason; the scale stays 1.
        assert [r["skipped"] for r in rows] == [i in expected for i in range(STEPS)], (rank, rows)
        assert [r["reason"] for r in rows] == [
            int(expected.get(i, SkipReason.NONE)) for i in range(STEPS)
        ]
        assert {r["scale"] for r in rows} == {1.0}
        # The prepared scheduler held on both (it steps once per process on a taken step).
        taken = STEPS - len(expected)
        assert rows[-1]["sched"] == 2 * taken
        assert rows[-1]["lr"] == pytest.approx(1e-2 / (1.0 + 2 * taken), rel=1e-12)
        # No scheduler step read a flag on the host (Accelerate's own asks bool() each step).
        assert res["reads"] == [[]] * len(res["reads"]) and len(res["reads"]) >= STEPS
        # The second nan step in a row raises on every rank, at that step, naming the reason.
        assert res["streak"] == {
            "step": STEPS + 1, "streak": 2, "reasons": [int(SkipReason.NONFINITE)]
        }  # fmt: skip
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)
