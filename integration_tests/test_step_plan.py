"""The step plan across real gloo ranks: warm FSDP2 steps give what cold ones give.

Every step of a sequence runs twice on the same gradients: warm (through the
plan the previous step left) and cold (its plans forgotten), on FSDP2
parameters mixed with plain replicated ones, and the two must agree bit for
bit (norm, found_inf, every local gradient after the multiply) while the
layout changes between steps: new gradient tensors, a gradient dropped on one
rank only, another declaration of the plain tensors. A rank whose aliasing
check fails on a warm step still joins the all-reduce: every rank raises
within seconds. And the plans a scaler keeps leave an FSDP2 model movable:
``module.to()`` swaps DTensor parameters with ``swap_tensors``, which refuses
any tensor with a weak reference.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool
from torch import nn

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

FAST = 15.0  # an error carried in the step's all-reduce arrives well within this
SCALE = 1024.0


def _setup() -> tuple[list[nn.Parameter], Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardscale.core import get_registry
    from shardscale.core.step import StepConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(3, 5))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    extra = [nn.Parameter(torch.randn(5)) for _ in range(2)]  # plain, replicated on every rank
    registry = get_registry()
    config = StepConfig(backend=registry.make_backend("c10d"), registry=registry)
    return [*model.parameters(), *extra], config


def _new_grads(params: list[nn.Parameter], step: int) -> None:
    """Fresh gradient tensors, as zero_grad(set_to_none=True) and a backward would leave."""
    from torch.distributed.tensor import DTensor

    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    for i, p in enumerate(params):
        if isinstance(p, DTensor):
            local = torch.randn(p.to_local().shape, generator=gen) * SCALE
            p.grad = DTensor.from_local(
                local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        else:
            # Replicas: the same values on every rank.
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * SCALE


def _locals(params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    from torch.distributed.tensor import DTensor

    return [
        None if p.grad is None else p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        for p in params
    ]


def _run(params: list[nn.Parameter], config: Any, plans: Any) -> tuple[float, float, list[Any]]:
    from shardscale.core.step import Apply, StepRequest, run_step

    result = run_step(
        params, config, StepRequest(apply=Apply.MULTIPLY, norm_type=2.0, max_norm=0.5,
        scale=torch.tensor(SCALE), plans=plans),
    )  # fmt: skip
    assert result.norm is not None
    grads = [None if g is None else g.clone() for g in _locals(params)]
    return float(result.norm), float(result.found_inf), grads


def _warm_and_cold(params: list[nn.Parameter], config: Any, plans: Any) -> dict[str, Any]:
    saved = [None if g is None else g.clone() for g in _locals(params)]
    uses = sum(plan.uses for plan in plans)
    warm = _run(params, config, plans)
    reused = sum(plan.uses for plan in plans) - uses
    for g, s in zip(_locals(params), saved, strict=True):
        if g is not None:
            g.copy_(s)  # type: ignore[arg-type]
    cold = _run(params, config, None)  # no plans: a cold step
    same = warm[:2] == cold[:2] and all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(warm[2], cold[2], strict=True)
    )
    return {"same": same, "reused": reused, "norm": warm[0], "cold_norm": cold[0]}


def _sequence_case() -> list[dict[str, Any]]:
    import dataclasses

    from shardscale.core.step import StepPlans

    params, config = _setup()
    plans = StepPlans()
    star = dataclasses.replace(config, distinct_dims=frozenset({"*"}))
    out = []
    for step, (what, cfg) in enumerate([
        ("first", config), ("new grads", config), ("new grads", config),
        ("a grad dropped on rank 1", config), ("again", config),
        ("plain tensors declared distinct", star), ("back", config),
    ]):  # fmt: skip
        _new_grads(params, step)
        if what.startswith("a grad dropped") and dist.get_rank() == 1:
            params[2].grad = None
        if what == "again" and dist.get_rank() == 1:
            params[2].grad = None
        out.append({"what": what, **_warm_and_cold(params, cfg, plans)})
    return out


def test_warm_fsdp2_steps_match_cold_ones_through_layout_changes(pool2: Pool) -> None:
    results = pool2.run(_sequence_case, timeout=120)
    for rank, steps in enumerate(results):
        assert isinstance(steps, list)
        for s in steps:
            assert s["same"], (rank, s)
        reused = {s["what"]: s["reused"] for s in steps}
        # The plan was taken where nothing changed, and not where something did.
        assert reused["first"] == 0 and reused["new grads"] == 1 and reused["again"] == 1
        # Another declaration counts the plain replicas on both ranks: a plan of its own.
        assert reused["plain tensors declared distinct"] == 0


def _aliased_case() -> dict[str, Any]:
    from shardscale.core.step import StepPlans

    params, config = _setup()
    plans = StepPlans()
    for step in range(2):
        _new_grads(params, step)
        _run(params, config, plans)  # the second step is warm
    _new_grads(params, 2)
    if dist.get_rank() == 1:
        params[-1].grad = params[-2].grad  # two replicas share one gradient on rank 1 only
    started = time.monotonic()
    try:
        _run(params, config, plans)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"rank": dist.get_rank(), "error": error, "elapsed": time.monotonic() - started}


def test_a_warm_step_that_fails_on_one_rank_raises_on_every_rank(pool2: Pool) -> None:
    results = pool2.run(_aliased_case, timeout=90)
    good, bad = results
    assert isinstance(good, dict) and isinstance(bad, dict)
    assert bad["error"] is not None and bad["error"].startswith("AliasedGradientError"), bad
    assert good["error"] is not None and good["error"].startswith("StepError"), good
    assert "rank(s) [1]" in good["error"], good
    assert max(good["elapsed"], bad["elapsed"]) < FAST


def _module_move_case() -> dict[str, Any]:
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardscale.clip import unscale_and_clip_
    from shardscale.core import ShardedGradScaler

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = copy.deepcopy(reference)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=SCALE)
    moved, reports = [], []
    for step in range(4):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        if step == 2 and dist.get_rank() == 1:
            next(iter(model[1].parameters())).grad._local_tensor[0] = float("inf")  # type: ignore[union-attr]
        if step % 2:
            scaler.unscale_(opt)
        else:
            unscale_and_clip_(scaler, opt, max_norm=1.0)
        scaler.step(opt)
        scaler.update()
        if step == 2:
            reports.append(str(scaler.overflow_report(module=model)))
        opt.zero_grad()
        # What verl's checkpoint and offload do between steps: every DTensor parameter swapped.
        try:
            model.to("cpu")
            moved.append(True)
        except RuntimeError as exc:
            moved.append(f"{exc}: {exc.__cause__}")
    return {"moved": moved, "skipped": [float(scaler.get_scale())], "reports": reports}


def test_an_fsdp2_model_moves_between_scaler_steps(pool2: Pool) -> None:
    results = pool2.run(_module_move_case, timeout=120)
    for rank, out in enumerate(results):
        assert isinstance(out, dict)
        assert out["moved"] == [True] * 4, (rank, out["moved"])
        # The inf on rank 1 at step 2: one backoff (2**-1) on every rank.
        assert out["skipped"] == [SCALE / 2], (rank, out)
        (report,) = out["reports"]
        assert "skipped (overflow)" in report and "rank 1: 1.weight" in report, (rank, report)
