"""The step verdict on 4 gloo ranks: every rank skips the same steps as a single-process reference.

One process group for the module. The pipeline and expert setups are those of
``test_pipeline_expert`` (4 plain stages; 2 stages x 2 FSDP2 ranks; DTensor
experts; plain experts declared in ``distinct_params``; experts over ``ep``
with FSDP2 over ``efsdp``). Each rank also trains an unsharded reference of
the same model on the whole batch in its own process, which decides with the
rules written here (a non-finite norm skips; the spike rule with Python's
``statistics`` over its own accepted norms) and steps only on the steps it
takes. The event -- a nan, or a gradient spike -- is injected on ONE rank: a
pipeline stage that never sees the loss, or one expert shard; or the last
stage, the only one holding a loss, observes a non-finite one.

Also: the spike window after a ``torch.distributed.checkpoint`` resume equals
the uninterrupted run's, and a streak of skips stops every rank at the same
step.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from typing import Any

import pytest
import test_pipeline_expert as pe
import torch
import torch.distributed as dist
from mp_harness import Pool
from tolerances import clipped_grad_rtol, norm_rtol
from torch import nn

from shardscale.core import SkipReason
from shardscale.core.step import VectorLayout

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

STEPS = 7
EVENT_STEP = 5
SPIKE_FACTOR = 1e3
# Armed after 3 accepted steps, so the event at step 5 is tested against the window.
SPIKE: dict[str, Any] = {"z": 6.0, "window": 4, "warmup": 3}


def reference_is_spike(norm: float, accepted: list[float], policy: dict[str, Any]) -> bool:
    """The documented spike rule on Python floats (not shardscale's code)."""
    if not math.isfinite(norm) or len(accepted) < policy["warmup"]:
        return False
    recent = accepted[-policy["window"] :]
    return norm > statistics.fmean(recent) + policy["z"] * statistics.stdev(recent)


def _local(g: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return g._local_tensor if isinstance(g, DTensor) else g


def _nan_first(params: list[torch.Tensor]) -> None:
    """One element of the first non-empty local gradient becomes nan (bf16's failure)."""
    for p in params:
        if p.grad is not None and _local(p.grad).numel():
            _local(p.grad).view(-1)[0] = math.nan
            return
    raise AssertionError("no local gradient to poison")


def _spike(setup: pe.Setup, ref: nn.Module, *, ours: bool) -> None:
    """Multiply the poisoned rank's own gradients (its stage, or its experts) by SPIKE_FACTOR.

    On the reference: the same parameters' gradients (the stage's layers, or the
    rows of the stacked expert weights that rank holds).
    """
    if isinstance(setup, pe.PipelineSetup):
        assert setup.dp == 1, "a stage's local gradients are then whole tensors"
        params = setup.params() if ours else pe._matching_ref_params(setup, ref)
        for p in params:
            assert p.grad is not None
            _local(p.grad).mul_(SPIKE_FACTOR)
        return
    assert isinstance(setup, pe.ExpertSetup) and setup.style in ("ep", "ep_plain")
    per = pe.N_EXPERTS // dist.get_world_size()
    rows = slice(setup.poison_rank * per, (setup.poison_rank + 1) * per)
    experts = setup.model.experts if ours else ref.experts  # type: ignore[union-attr]
    for w in (experts.w1, experts.w2):
        assert w.grad is not None
        target = _local(w.grad) if ours else w.grad[rows]
        target.mul_(SPIKE_FACTOR)


def verdict_case(name: str, event: str) -> dict[str, Any]:
    from shardscale.clip import unscale_and_clip_
    from shardscale.collectives import CountingMiddleware, find_middleware
    from shardscale.core import ShardedGradScaler, SpikeSkip

    setup = pe.SETUPS[name]()
    ref = pe.reference_model(name)
    rank = dist.get_rank()
    opt = torch.optim.SGD(setup.params(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scaler = ShardedGradScaler(
        "cpu",
        backend="counting+c10d",
        distinct_dims=setup.distinct_dims,
        distinct_params=setup.distinct_params,
        loss_scaling=False,
        spike=SpikeSkip(**SPIKE),
    )
    counter = find_middleware(scaler.backend, CountingMiddleware)
    out: dict[str, Any] = {k: [] for k in ("norms", "ref_norms", "skipped", "ref_skipped")}
    out["reasons"], out["counted"] = [], []
    accepted: list[float] = []
    for step in range(STEPS):
        x, y = pe.batch(step)
        hit = step == EVENT_STEP
        # Reference: the whole batch in one process; it decides with the rules written above.
        ref_opt.zero_grad(set_to_none=True)
        pe.loss_sum(ref(x), y).backward()
        if hit:
            if event == "nan":
                _nan_first(pe._matching_ref_params(setup, ref))
            else:
                _spike(setup, ref, ours=False)
        grads = [p.grad for p in ref.parameters() if p.grad is not None]
        ref_norm = float(torch.nn.utils.get_total_norm(grads))
        skip = not math.isfinite(ref_norm) or reference_is_spike(ref_norm, accepted, SPIKE)
        skip = skip or (hit and event == "loss")  # the reference's loss was not finite
        if not skip:
            accepted.append(ref_norm)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), pe.MAX_NORM)
            ref_opt.step()
        out["ref_norms"].append(ref_norm)
        out["ref_skipped"].append(skip)
        # Ours: the event on one rank only.
        opt.zero_grad(set_to_none=True)
        setup.forward_backward(scaler, x, y)
        if hit and event == "loss" and getattr(setup, "is_last", False):
            # Only the last stage holds the loss; the others add 0 to the vector's slot.
            scaler.observe_loss(torch.tensor(math.inf))
        elif hit and rank == setup.poison_rank:
            if event == "nan":
                _nan_first(setup.params())
            else:
                _spike(setup, ref, ours=True)
        counter.reset()
        norm = unscale_and_clip_(scaler, opt, pe.MAX_NORM)
        scaler.step(opt)
        scaler.update()
        out["counted"].append([(r.op.value, r.numel) for r in counter.records])
        out["norms"].append(float(norm))
        out["skipped"].append(bool(scaler.last_step_skipped))
        out["reasons"].append(int(scaler.last_skip_reason))  # type: ignore[arg-type]
    ours, theirs = setup.full_params(), setup.ref_params(ref)
    out["param_diff"] = max(
        float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, theirs, strict=True)
    )
    out["numel"] = sum(p.numel() for p in ref.parameters())
    out["window"] = scaler.state_dict()["spike_window"]
    return out


CASES = [
    ("pp", "spike"),  # a stage that never sees the loss
    ("pp", "loss"),  # a non-finite loss, held by the last stage only
    ("ep", "spike"),  # one DTensor expert shard
    ("ep_plain", "spike"),  # one rank's plain experts (distinct_params)
    ("pp_fsdp", "nan"),  # FSDP2 inside the first stage, on its dp rank 0
    ("ep_fsdp", "nan"),  # experts over ep x efsdp, dense layers FSDP2 over all ranks
]


@pytest.mark.parametrize(("name", "event"), CASES, ids=[f"{n}-{e}" for n, e in CASES])
def test_every_rank_decides_as_the_reference(pool4: Pool, name: str, event: str) -> None:
    results: list[dict[str, Any]] = pool4.run(verdict_case, name, event)  # type: ignore[assignment]
    first = results[0]
    world = len(results)
    want = {"spike": SkipReason.SPIKE, "nan": SkipReason.NONFINITE, "loss": SkipReason.LOSS}[event]
    # Norms of gradients that agree to rounding, summed in different orders (as in
    # test_pipeline_expert): twice the norm bound plus one rounding per summed row.
    bound = (
        2 * norm_rtol(first["numel"], torch.float32, 2.0)
        + 2 * pe.ROWS * torch.finfo(torch.float32).eps
    )
    param_bound = STEPS * 2 * clipped_grad_rtol(first["numel"], torch.float32, 2.0) + bound
    for rank, res in enumerate(results):
        assert res["ref_skipped"] == [s == EVENT_STEP for s in range(STEPS)], res["ref_skipped"]
        assert res["skipped"] == res["ref_skipped"], f"rank {rank}: {res['skipped']}"
        assert res["reasons"] == [want if s == EVENT_STEP else 0 for s in range(STEPS)]
        assert [repr(n) for n in res["norms"]] == [repr(n) for n in first["norms"]]
        for step, (ours, ref) in enumerate(zip(res["norms"], res["ref_norms"], strict=True)):
            if math.isfinite(ref):
                assert abs(ours - ref) <= bound * ref, f"rank {rank} step {step}: {ours} vs {ref}"
            else:
                assert not math.isfinite(ours)
        # One all-reduce per step, the vector of the layout (loss_nonfinite included).
        assert all(c == [("sum", VectorLayout(world).size)] for c in res["counted"])
        assert res["param_diff"] <= param_bound, f"rank {rank}: {res['param_diff']}"
        assert res["window"] == first["window"]  # fed from the reduced norm: the same everywhere
    assert len(first["window"]) == SPIKE["window"]


def fsdp_spike_case() -> dict[str, Any]:
    """1-D FSDP2 over every rank; rank 3's loss share is x1e3 at the event (step alone, fp16)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardscale.core import ShardedGradScaler, SpikeSkip

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = pe.chain(), pe.chain()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    pe._sum_gradients(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10, spike=SpikeSkip(**SPIKE))
    out: dict[str, Any] = {"skipped": [], "ref_skipped": [], "reasons": []}
    accepted: list[float] = []
    for step in range(STEPS):
        x, y = pe.batch(step)
        factors = [SPIKE_FACTOR if (step == EVENT_STEP and r == 3) else 1.0 for r in range(world)]
        # Reference: every rank's share of the loss, the spiking one included, in one process.
        ref_opt.zero_grad(set_to_none=True)
        shares = zip(x.chunk(world), y.chunk(world), factors, strict=True)
        sum(f * pe.loss_sum(ref(xr), yr) for xr, yr, f in shares).backward()  # type: ignore[union-attr]
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
        skip = reference_is_spike(norm, accepted, SPIKE)
        if not skip:
            accepted.append(norm)
            ref_opt.step()
        out["ref_skipped"].append(skip)
        # Ours: no clip call, so the step computes the norm in its one read and all-reduce.
        opt.zero_grad(set_to_none=True)
        loss = pe.loss_sum(model(x.chunk(world)[rank]), y.chunk(world)[rank]) * factors[rank]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        out["skipped"].append(bool(scaler.last_step_skipped))
        out["reasons"].append(int(scaler.last_skip_reason))  # type: ignore[arg-type]
    theirs = [p.detach() for p in ref.parameters()]
    ours = [pe._full(p) for p in model.parameters()]
    out["param_diff"] = max(
        float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, theirs, strict=True)
    )
    out["numel"] = sum(p.numel() for p in ref.parameters())
    out["scale"] = scaler.get_scale()
    return out


def test_a_spike_on_one_fsdp2_rank_without_a_clip_call(pool4: Pool) -> None:
    results: list[dict[str, Any]] = pool4.run(fsdp_spike_case)  # type: ignore[assignment]
    # Unclipped SGD steps on gradients that agree to rounding (a reduce-scatter sums the
    # shares in another order): one rounding per summed row per step, accumulated.
    bound = STEPS * 4 * pe.ROWS * torch.finfo(torch.float32).eps
    for rank, res in enumerate(results):
        assert res["ref_skipped"] == [s == EVENT_STEP for s in range(STEPS)], res["ref_skipped"]
        assert res["skipped"] == res["ref_skipped"], f"rank {rank}: {res['skipped']}"
        assert res["reasons"] == [SkipReason.SPIKE if s == EVENT_STEP else 0 for s in range(STEPS)]
        assert res["param_diff"] <= bound, f"rank {rank}: {res['param_diff']}"
        assert res["scale"] == 2.0**10  # a spike does not back the scale off


# -- checkpoint and streak on a 1-D FSDP2 model ---------------------------------------------------


class _App:
    """Model and optimizer as one DCP Stateful (torch's get/set_state_dict)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


def _fsdp_model(**scaler_kw: Any) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardscale.core import ShardedGradScaler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return model, opt, ShardedGradScaler("cpu", loss_scaling=False, **scaler_kw)


def _fsdp_steps(
    model: nn.Module, opt: torch.optim.Optimizer, scaler: Any, steps: range, events: dict[int, str]
) -> list[int]:
    """Train; ``events`` maps a step to "spike" (rank 1's loss x1e3) or "nan" (rank 3's loss)."""
    rank = dist.get_rank()
    reasons = []
    for step in steps:
        opt.zero_grad(set_to_none=True)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        loss = model(x).pow(2).mean()
        event = events.get(step)
        if event == "spike" and rank == 1:
            loss = loss * SPIKE_FACTOR
        if event == "nan" and rank == 3:
            loss = loss * math.nan
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        reasons.append(int(scaler.last_skip_reason))
    return reasons


RESUME_SPIKE: dict[str, Any] = {"z": 6.0, "window": 4, "warmup": 2}
RESUME_EVENTS = {6: "spike", 9: "spike"}


def resume_case(directory: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from shardscale.core import SpikeSkip

    total, split = 11, 5
    model, opt, scaler = _fsdp_model(spike=SpikeSkip(**RESUME_SPIKE))
    uninterrupted = _fsdp_steps(model, opt, scaler, range(total), RESUME_EVENTS)
    whole = scaler.state_dict()
    model, opt, scaler = _fsdp_model(spike=SpikeSkip(**RESUME_SPIKE))
    head = _fsdp_steps(model, opt, scaler, range(split), RESUME_EVENTS)
    dcp.save({"app": _App(model, opt), "scaler": scaler}, checkpoint_id=directory)
    model, opt, scaler = _fsdp_model(spike=SpikeSkip(**RESUME_SPIKE))
    dcp.load({"app": _App(model, opt), "scaler": scaler}, checkpoint_id=directory)
    loaded = scaler.state_dict()
    tail = _fsdp_steps(model, opt, scaler, range(split, total), RESUME_EVENTS)
    return {
        "uninterrupted": uninterrupted,
        "resumed": head + tail,
        "whole": whole,
        "after_resume": scaler.state_dict(),
        "loaded_count": loaded["spike_accepted"],
    }


def test_the_spike_window_after_a_dcp_resume_equals_the_uninterrupted_runs(pool4: Pool) -> None:
    with tempfile.TemporaryDirectory() as directory:  # every rank shares this machine's disk
        results: list[dict[str, Any]] = pool4.run(resume_case, directory)  # type: ignore[assignment]
    first = results[0]
    spike = int(SkipReason.SPIKE)
    # Both injected spikes are skipped, every other step taken (the rule must have something
    # to do: the second spike is judged by a window that crossed the checkpoint).
    assert first["uninterrupted"] == [spike if s in RESUME_EVENTS else 0 for s in range(11)]
    for res in results:
        assert res["resumed"] == res["uninterrupted"] == first["uninterrupted"]
        assert res["loaded_count"] == 5  # the five steps before the checkpoint, all accepted
        assert res["after_resume"] == res["whole"] == first["whole"]


def streak_case() -> dict[str, Any]:
    from shardscale.core import SkipStreakError

    model, opt, scaler = _fsdp_model(max_consecutive_skips=2)
    events = {1: "nan", 3: "nan", 4: "nan", 5: "nan"}
    out: dict[str, Any] = {"raised_at": None}
    reasons: list[int] = []
    for step in range(7):
        try:
            reasons += _fsdp_steps(model, opt, scaler, range(step, step + 1), events)
        except SkipStreakError as exc:
            out.update(raised_at=step, step=exc.step, streak=exc.streak, message=str(exc))
            out["reasons"] = [int(r) for r in exc.reasons]
            break
    out["seen"] = reasons
    return out


def test_a_streak_stops_every_rank_at_the_same_step(pool4: Pool) -> None:
    results: list[dict[str, Any]] = pool4.run(streak_case)  # type: ignore[assignment]
    nonfinite = int(SkipReason.NONFINITE)
    for res in results:
        # Step 1 alone is no streak; steps 3 and 4 are: every rank raises at step 4's update.
        assert res["raised_at"] == 4, res
        assert res["step"] == 5 and res["streak"] == 2 and res["reasons"] == [nonfinite]
        assert res["seen"] == [0, nonfinite, 0, nonfinite]  # what update() published before
        assert res["message"] == results[0]["message"]
