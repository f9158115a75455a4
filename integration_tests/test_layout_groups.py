"""One adapter call per layout: the bulk walk gives what asking every parameter gives, on 4 ranks.

One optimizer's worth of parameters mixes every layout the adapters know:
Shard(0) and Replicate on a 1-D mesh, an uneven Shard(0) (rank 3 holds an
empty shard), (Shard, Replicate) and (Replicate, Shard) on a 2x2 mesh, a
bfloat16 DTensor (a bucket of its own), plain replicated tensors, a plain
tensor declared distinct (different on every rank) and a parameter without a
gradient, interleaved so that bucket order matters. On every rank:

* the bulk walk (``collect_grads``) and the walk that asks each parameter's
  adapter (``_collect_each``, the reference) give the same buckets: the same
  keys in the same order, the very same local tensors, owners, counts and
  trace;
* each copy's ``counts`` is what the layout says, worked out here from the
  placements and mesh coordinates (the copy at coordinate 0 of every
  replicated dim counts);
* a cold step (its plans forgotten) and the warm step after it agree bit for
  bit (norm, found_inf, every local gradient after the clip), and the norm
  is the one torch computes in float64 from the full gradients.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool
from tolerances import norm_rtol
from torch import nn

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SCALE = 512.0


def _case() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from shardscale.core import get_registry
    from shardscale.core.step import Apply, StepConfig, StepPlans, StepRequest, run_step
    from shardscale.core.step._buckets import Trace
    from shardscale.core.step._collect import _collect_each, collect_grads

    rank, world = dist.get_rank(), dist.get_world_size()
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    grid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    dp, tp = grid.get_coordinate()  # type: ignore[misc]
    # (name, shape, dtype, mesh, placements, whether this rank's copy counts); mesh None: plain.
    layouts: list[tuple[str, tuple[int, ...], torch.dtype, Any, Any, bool]] = [
        ("plain replica", (5,), torch.float32, None, None, rank == 0),
        ("shard", (8, 3), torch.float32, flat, (Shard(0),), True),
        ("bf16 shard", (8,), torch.bfloat16, flat, (Shard(0),), True),
        ("replicate", (5,), torch.float32, flat, (Replicate(),), rank == 0),
        ("uneven shard", (3, 2), torch.float32, flat, (Shard(0),), True),
        ("shard, replicate", (4, 2), torch.float32, grid, (Shard(0), Replicate()), tp == 0),
        ("no grad", (4,), torch.float32, flat, (Shard(0),), False),
        ("replicate, shard", (4, 2), torch.float32, grid, (Replicate(), Shard(0)), dp == 0),
        ("shard", (8, 3), torch.float32, flat, (Shard(0),), True),
        ("plain distinct", (3,), torch.float32, None, None, True),
        ("bf16 shard", (8,), torch.bfloat16, flat, (Shard(0),), True),
        ("plain replica", (2, 2), torch.float32, None, None, rank == 0),
        ("shard", (8, 3), torch.float32, flat, (Shard(0),), True),
    ]
    params: list[nn.Parameter] = []
    fulls: list[torch.Tensor | None] = []  # every rank's view of each full gradient
    for i, (name, shape, dtype, mesh, placements, _) in enumerate(layouts):
        gen = torch.Generator().manual_seed(i)  # the same full values on every rank
        full = (torch.randn(shape, generator=gen) * SCALE).to(dtype)
        if name == "plain distinct":  # each rank its own values
            full = torch.randn(shape, generator=torch.Generator().manual_seed(99 + rank)) * SCALE
        if mesh is None:
            param = nn.Parameter(torch.zeros(shape, dtype=dtype))
            param.grad = full.clone()
        else:
            param = nn.Parameter(
                distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, placements)
            )
            param.grad = distribute_tensor(full, mesh, placements)
        if name == "no grad":
            param.grad = None
            full = None
        params.append(param)
        fulls.append(full)
    distinct = next(p for p, lay in zip(params, layouts, strict=True) if lay[0] == "plain distinct")
    registry = get_registry()
    config = StepConfig(
        backend=registry.make_backend("c10d"),
        registry=registry,
        distinct_params=frozenset({id(distinct)}),
    )
    ctx, ranks = config.adapter_context(), tuple(range(world))

    # 1. The bulk walk against the reference walk, tensor for tensor.
    bulk_trace, each_trace = Trace(), Trace()
    bulk = collect_grads(params, ctx, registry, group_ranks=ranks, trace=bulk_trace)
    each = _collect_each(
        params, ctx, registry, group_ranks=ranks, coalesce_sparse=True, as_grads=False,
        trace=each_trace,
    )  # fmt: skip
    same_buckets = (
        list(bulk.every) == list(each.every)
        and all(
            len(bulk.every[k]) == len(each.every[k])
            and all(map(lambda a, b: a is b, bulk.every[k], each.every[k]))
            and all(map(lambda a, b: a is b, bulk.owners[k], each.owners[k]))
            and bulk.counts_mask[k] == each.counts_mask[k]
            and list(map(id, bulk.counted.get(k, []))) == list(map(id, each.counted.get(k, [])))
            for k in bulk.every
        )
        and bulk.count == each.count
        and bulk_trace.positions == each_trace.positions
        and all(map(lambda a, b: a is b, bulk_trace.locals, each_trace.locals))
        and bulk_trace.stable is each_trace.stable is True
    )
    # 2. counts against the layouts themselves.
    by_param = {
        id(p): c
        for k in bulk.every
        for p, c in zip(bulk.owners[k], bulk.counts_mask[k], strict=True)
    }
    counts_ok = [
        (lay[0], by_param.get(id(p)), lay[5])
        for p, lay in zip(params, layouts, strict=True)
        if p.grad is not None and by_param.get(id(p)) != lay[5]
    ]

    # 3. Cold, then warm, bit for bit; the norm against torch's float64 one.
    def local_grads() -> list[torch.Tensor | None]:
        return [
            None if p.grad is None
            else p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in params
        ]  # fmt: skip

    saved = [None if g is None else g.clone() for g in local_grads()]

    def step() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
        result = run_step(
            params, config, StepRequest(apply=Apply.MULTIPLY, norm_type=2.0, max_norm=1.0,
            scale=torch.tensor(SCALE), plans=plans),
        )  # fmt: skip
        assert result.norm is not None
        after = [None if g is None else g.clone() for g in local_grads()]
        for g, s in zip(local_grads(), saved, strict=True):
            if g is not None and s is not None:
                g.copy_(s)
        return result.norm, result.found_inf, after

    plans = StepPlans()  # none kept yet: the first step is cold
    cold = step()
    uses = sum(plan.uses for plan in plans)
    warm = step()
    reused = sum(plan.uses for plan in plans) - uses
    bitwise = (
        torch.equal(cold[0], warm[0])
        and torch.equal(cold[1], warm[1])
        and all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(cold[2], warm[2], strict=True)
        )
    )
    # torch's reference: every full gradient once, the distinct one once per rank.
    total, numel = 0.0, 0
    for (name, *_), full in zip(layouts, fulls, strict=True):
        if full is None:
            continue
        if name == "plain distinct":
            per_rank = [
                torch.randn(full.shape, generator=torch.Generator().manual_seed(99 + r)) * SCALE
                for r in range(world)
            ]
            total += sum(float(t.double().pow(2).sum()) for t in per_rank)
            numel += full.numel() * world
        else:
            total += float(full.double().pow(2).sum())
            numel += full.numel()
    reference = math.sqrt(total) / SCALE
    return {
        "same_buckets": same_buckets,
        "wrong_counts": counts_ok,
        "bitwise": bitwise,
        "reused": reused,
        "norm": float(cold[0]),
        "reference": reference,
        "numel": numel,
        "buckets": [str(k[1]) for k in bulk.every],
    }


def test_bulk_walk_matches_the_per_parameter_walk_and_torch_on_mixed_layouts(pool4: Pool) -> None:
    results = pool4.run(_case, timeout=180)
    for rank, r in enumerate(results):
        assert isinstance(r, dict)
        assert r["same_buckets"], (rank, r)
        assert r["wrong_counts"] == [], (rank, r["wrong_counts"])
        assert r["bitwise"] and r["reused"] == 1, (rank, r)
        # Buckets in first-seen order: float32 (the plain replica first), then bfloat16.
        assert r["buckets"] == ["torch.float32", "torch.bfloat16"], r["buckets"]
        # float32 accumulation of per-tensor norms (the bf16 values are exact in float64).
        rtol = norm_rtol(r["numel"], torch.float32, 2.0)
        assert math.isclose(r["norm"], r["reference"], rel_tol=rtol), (rank, r)
