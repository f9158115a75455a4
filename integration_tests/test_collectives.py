"""shardscale.collectives over real gloo process groups of 2 and 4 ranks.

Each case runs on every rank of a module-wide pool (see mp_harness); expected
values are computed here in the parent from the same per-rank inputs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool

from shardscale.core.step import VectorLayout
from shardscale.core.testing import COUNTING_GLOO

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORLD_POOLS = ["pool2", "pool4"]


def _pool(request: pytest.FixtureRequest, name: str) -> Pool:
    pool: Pool = request.getfixturevalue(name)
    return pool


# -- per-rank inputs, shared by the workers and the parent's expectations ------------------------

DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}


def _input(rank: int, dtype_name: str) -> list[float]:
    """A small rank-dependent vector (exact in every dtype used)."""
    return [rank + 1.0, -2.0 * rank, 3.0 * rank - 1.0, 7.0 if rank % 2 else -7.0]


def _expected(world: int, dtype_name: str, op: str) -> list[float]:
    columns = list(zip(*(_input(r, dtype_name) for r in range(world)), strict=True))
    return [float(sum(c)) if op == "sum" else float(max(c)) for c in columns]


# -- cases (run inside the workers) -------------------------------------------------------------


def _reduce_case(spec: str) -> dict[tuple[str, str], list[float]]:
    from shardscale.core import ReduceOp, get_registry

    backend = get_registry().make_backend(spec)
    rank = dist.get_rank()
    out = {}
    for dtype_name, dtype in DTYPES.items():
        for op in (ReduceOp.SUM, ReduceOp.MAX):
            tensor = torch.tensor(_input(rank, dtype_name), dtype=dtype)
            backend.all_reduce(tensor, op=op, group=None).wait()
            out[(dtype_name, op.value)] = [float(v) for v in tensor.tolist()]
    return out


def _parity_groups() -> tuple[dist.ProcessGroup, list[int]]:
    world = dist.get_world_size()
    groups = {p: [r for r in range(world) if r % 2 == p] for p in (0, 1)}
    made = {p: dist.new_group(ranks) for p, ranks in groups.items()}  # every rank creates both
    mine = dist.get_rank() % 2
    return made[mine], groups[mine]


def _coalescing_case() -> dict[str, Any]:
    from shardscale.collectives import CoalescingMiddleware, CountingMiddleware
    from shardscale.core import ReduceOp, get_registry

    backend = get_registry().make_backend("counting+coalescing+counting+c10d")
    assert isinstance(backend, CountingMiddleware)
    assert isinstance(backend.inner, CoalescingMiddleware)
    outer, inner = backend, backend.inner.inner
    assert isinstance(inner, CountingMiddleware)
    rank = dist.get_rank()
    parity_group, _ = _parity_groups()
    plan = [  # (dtype, op, group) in program order, interleaved on purpose
        ("float32", ReduceOp.SUM, None),
        ("float32", ReduceOp.MAX, None),
        ("float64", ReduceOp.SUM, None),
        ("float32", ReduceOp.SUM, parity_group),
        ("float32", ReduceOp.SUM, None),
        ("float32", ReduceOp.MAX, None),
        ("float64", ReduceOp.SUM, None),
        ("float32", ReduceOp.SUM, parity_group),
        ("float32", ReduceOp.SUM, None),
    ]
    tensors, handles = [], []
    for i, (dtype_name, op, group) in enumerate(plan):
        # Each request scaled differently so a copy-back mix-up would show.
        tensor = torch.tensor(_input(rank, dtype_name), dtype=DTYPES[dtype_name]) * (i + 1)
        tensors.append(tensor)
        handles.append(backend.all_reduce(tensor, op=op, group=group))
    issued_before_wait = len(inner.records)
    for handle in reversed(handles):
        handle.wait()
    return {
        "requests_seen_outside": len(outer.records),
        "issued_before_wait": issued_before_wait,
        "issued": [(r.op.value, str(r.dtype), r.numel, r.group_size) for r in inner.records],
        "results": [[float(v) for v in t.tolist()] for t in tensors],
    }


def _custom_backend_case() -> dict[str, Any]:
    from shardscale.collectives import CountingMiddleware, find_middleware
    from shardscale.core import BackendUnavailableError, ReduceOp, get_registry
    from shardscale.core.testing import CountingGlooGroup, counting_gloo_group

    group = counting_gloo_group()
    rank = dist.get_rank()
    backend = get_registry().make_backend("counting+c10d")
    calls_before = CountingGlooGroup.calls
    tensor = torch.tensor(_input(rank, "float32"))
    backend.all_reduce(tensor, op=ReduceOp.SUM, group=group).wait()
    peak = torch.tensor(_input(rank, "float32"))
    backend.all_reduce(peak, op=ReduceOp.MAX, group=group).wait()
    calls = CountingGlooGroup.calls - calls_before
    try:
        get_registry().make_backend("gloo").all_reduce(torch.ones(1), op=ReduceOp.SUM, group=group)
        refusal = ""
    except BackendUnavailableError as exc:
        refusal = str(exc)
    return {
        "backend_name": str(dist.get_backend(group)),
        "sum": tensor.tolist(),
        "max": peak.tolist(),
        "custom_calls": calls,
        "calls_after_refusal": CountingGlooGroup.calls - calls_before,
        "counted": len(find_middleware(backend, CountingMiddleware).records),
        "gloo_refusal": refusal,
    }


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)


def _scaler_ddp_case(steps: int, inf_steps: list[int], inf_rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from shardscale.collectives import CountingMiddleware, find_middleware
    from shardscale.core import ShardedGradScaler

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    kwargs: dict[str, Any] = {"init_scale": 2.0**8, "growth_interval": 2}
    scaler = ShardedGradScaler("cpu", backend="counting+c10d", **kwargs)
    ref_scaler = torch.amp.GradScaler("cpu", **kwargs)
    counting = find_middleware(scaler.backend, CountingMiddleware)
    per_step, scales, ref_scales = [], [], []
    for step in range(steps):
        x, y = _batch(step, rank)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        scaler.scale(loss).backward()
        if step in inf_steps and rank == inf_rank:
            first = next(ddp.parameters())
            assert first.grad is not None
            first.grad.view(-1)[0] = float("inf")
        before = len(counting.records)
        scaler.step(opt)
        per_step.append(len(counting.records) - before)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
        # The reference sees every rank's data at once: DDP's averaged gradient is the
        # gradient of the mean of the per-rank losses.
        ref_loss = (
            sum(
                torch.nn.functional.mse_loss(reference(xr), yr)
                for xr, yr in (_batch(step, r) for r in range(world))
            )
            / world
        )
        ref_scaler.scale(ref_loss).backward()
        if step in inf_steps:
            first_ref = next(reference.parameters())
            assert first_ref.grad is not None
            first_ref.grad.view(-1)[0] = float("inf")
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad(set_to_none=True)
        ref_scales.append(ref_scaler.get_scale())
    for param, ref_param in zip(ddp.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.detach(), ref_param.detach())
    return {
        "per_step": per_step,
        "records": sorted({(r.op.value, r.numel, r.group_size) for r in counting.records}),
        "scales": scales,
        "ref_scales": ref_scales,
        "params": [p.detach().clone() for p in ddp.module.parameters()],
    }


def _env_selection_case(spec: str) -> dict[str, Any]:
    import os

    from shardscale.collectives import CountingMiddleware, chain_names, find_middleware
    from shardscale.core import ShardedGradScaler
    from shardscale.core.plugins import BACKEND_ENV

    os.environ.pop(BACKEND_ENV, None)
    automatic = chain_names(ShardedGradScaler("cpu").backend)
    os.environ[BACKEND_ENV] = spec  # the harness restores the environment after the case
    scaler = ShardedGradScaler("cpu", init_scale=8.0)
    from_argument = chain_names(ShardedGradScaler("cpu", backend="gloo").backend)
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=1.0)
    skipped = []
    for step in range(2):
        scaler.scale(torch.ones(()))
        param.grad = torch.full((3,), 8.0)
        if step == 1 and dist.get_rank() == dist.get_world_size() - 1:
            param.grad[1] = float("nan")
        before = param.detach().clone()
        scaler.step(opt)
        scaler.update()
        skipped.append(bool(torch.equal(before, param.detach())))
    return {
        "automatic": automatic,
        "from_env": chain_names(scaler.backend),
        "from_argument": from_argument,
        "counted": len(find_middleware(scaler.backend, CountingMiddleware).records),
        "skipped": skipped,
        "scale": scaler.get_scale(),
    }


# -- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("pool_name", WORLD_POOLS)
@pytest.mark.parametrize("spec", ["c10d", "gloo", "counting+coalescing+c10d"])
def test_sum_and_max_match_hand_computed_values(
    request: pytest.FixtureRequest, pool_name: str, spec: str
) -> None:
    pool = _pool(request, pool_name)
    results = pool.run(_reduce_case, spec, timeout=60)
    for dtype_name in DTYPES:
        for op in ("sum", "max"):
            expected = _expected(pool.world_size, dtype_name, op)
            for rank, per_rank in enumerate(results):
                assert isinstance(per_rank, dict)
                assert per_rank[(dtype_name, op)] == expected, (rank, dtype_name, op)


@pytest.mark.parametrize("pool_name", WORLD_POOLS)
def test_coalescing_issues_one_collective_per_group_and_op(
    request: pytest.FixtureRequest, pool_name: str
) -> None:
    pool = _pool(request, pool_name)
    world = pool.world_size
    results = pool.run(_coalescing_case, timeout=60)
    for rank, result in enumerate(results):
        assert isinstance(result, dict)
        assert result["requests_seen_outside"] == 9
        assert result["issued_before_wait"] == 0
        parity_size = len([r for r in range(world) if r % 2 == rank % 2])
        # Batches leave in order of first request: (f32 SUM world), (f32 MAX world),
        # (f64 SUM world), (f32 SUM parity group); numel = 4 per request.
        assert result["issued"] == [
            ("sum", "torch.float32", 4 * 3, world),
            ("max", "torch.float32", 4 * 2, world),
            ("sum", "torch.float64", 4 * 2, world),
            ("sum", "torch.float32", 4 * 2, parity_size),
        ]
        ops = ["sum", "max", "sum", "parity", "sum", "max", "sum", "parity", "sum"]
        members = [r for r in range(world) if r % 2 == rank % 2]
        for i, (op, got) in enumerate(zip(ops, result["results"], strict=True)):
            ranks = members if op == "parity" else list(range(world))
            columns = list(zip(*(_input(r, "float32") for r in ranks), strict=True))
            reduce = max if op == "max" else sum
            assert got == [float(reduce(c)) * (i + 1) for c in columns], (rank, i)


@pytest.mark.parametrize("pool_name", WORLD_POOLS)
def test_custom_torch_backend_is_reached_through_c10d(
    request: pytest.FixtureRequest, pool_name: str
) -> None:
    pool = _pool(request, pool_name)
    results = pool.run(_custom_backend_case, timeout=60)
    for result in results:
        assert isinstance(result, dict)
        assert result["backend_name"] == COUNTING_GLOO
        assert result["sum"] == _expected(pool.world_size, "float32", "sum")
        assert result["max"] == _expected(pool.world_size, "float32", "max")
        assert result["custom_calls"] == 2
        assert result["counted"] == 2
        assert result["calls_after_refusal"] == 2  # gloo refused before issuing anything
        assert f"uses {COUNTING_GLOO!r} for cpu tensors" in result["gloo_refusal"]
        assert "'c10d'" in result["gloo_refusal"]


@pytest.mark.parametrize("pool_name", WORLD_POOLS)
def test_scaler_on_ddp_issues_one_collective_per_step_and_ranks_agree(
    request: pytest.FixtureRequest, pool_name: str
) -> None:
    pool = _pool(request, pool_name)
    world = pool.world_size
    steps, inf_steps = 7, [2, 5]
    results = pool.run(_scaler_ddp_case, steps, inf_steps, world - 1, timeout=120)
    first = results[0]
    assert isinstance(first, dict)
    for rank, result in enumerate(results):
        assert isinstance(result, dict)
        assert result["per_step"] == [1] * steps, rank
        # The engine's vector: 5 slots per rank (peak, power sum, non-finite, error, chain) + nan count.
        assert result["records"] == [("sum", VectorLayout(world).size, world)]
        # Same scale trajectory as torch's GradScaler on the unsharded reference.
        assert result["scales"] == result["ref_scales"], rank
        assert result["scales"] == first["scales"]
        for mine, theirs in zip(result["params"], first["params"], strict=True):
            assert torch.equal(mine, theirs), rank
    scales = first["scales"]
    # The injected steps backed off the scale on every rank (growth_interval=2 elsewhere).
    for step in inf_steps:
        before = scales[step - 1] if step else 2.0**8
        assert scales[step] == before / 2


@pytest.mark.parametrize("pool_name", ["pool2"])
def test_shardscale_backend_environment_selects_the_chain(
    request: pytest.FixtureRequest, pool_name: str
) -> None:
    pool = _pool(request, pool_name)
    results = pool.run(_env_selection_case, "counting+coalescing+c10d", timeout=60)
    for result in results:
        assert isinstance(result, dict)
        assert result["automatic"] == "c10d"
        assert result["from_env"] == "counting+coalescing+c10d"
        assert result["from_argument"] == "gloo"
        assert result["counted"] == 2
        assert result["skipped"] == [False, True]  # NaN on the last rank only skips everywhere
        assert result["scale"] == 4.0
