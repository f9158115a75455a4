"""Ranks never disagree: inf/nan at random steps, on random ranks, in random parameters.

Four ranks train for ``SHARDSCALE_FUZZ_STEPS`` steps (40 here; the ``stress``
nox session runs hundreds) in three layouts:

* ``replicated`` — plain parameters, identical on every rank (what DDP gives):
  every rank computes the same full-batch gradients. Besides injected
  non-finite values, a random rank sometimes *drops* a random parameter's
  gradient (``grad = None``) while the others keep theirs.
* ``fsdp2-1d`` — FSDP2 ``fully_shard`` over the 4 ranks, fused Adam (the path
  where FSDP1's own scaler skips the cross-rank reduction).
* ``fsdp-tp-2d`` — FSDP2 over ``dp`` by tensor parallel over ``tp`` (2 x 2).

A schedule drawn from one seed (the same on every rank) says, per step, which
ranks put an inf, -inf or nan into which parameter's local gradient, which
grads are dropped, and which entry point the step goes through: ``step``
alone, an explicit ``unscale_``, ``unscale_and_clip_``, or
``unscale_and_clip_`` with ``StreamingStats`` read during backward (the
reference then runs torch's ``unscale_`` + ``clip_grad_norm_``). The clip
limit is large, so clipping never changes a gradient and the replicated
layout can still be compared bit for bit; what is fuzzed is the decision. Every rank
also trains its own reference: the same model under ``torch.amp.GradScaler``
on the whole batch, told about overflows anywhere (an inf is put into its own
gradients whenever any rank really injected one), with the same dropped grads.

Asserted on every rank after every step: the scaler's skip decision (seen
through the ``shardscale_on_step`` hook) equals the global truth and is the
same on every rank; the scale is bit-identical on every rank and equal to the
reference's; parameters equal the reference's — bit for bit in the replicated
layout (and across ranks until the first dropped grad), to fp32
rounding for the sharded layouts, whose reduction order differs from one
process's. No step may hang: the harness bounds every case.
"""

from __future__ import annotations

import copy
import math
import os
import random
import struct
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool
from torch import nn

from shardscale.core import ShardedGradScaler, get_registry
from shardscale.core.testing import StepRecorder

STEPS = int(os.environ.get("SHARDSCALE_FUZZ_STEPS", "40"))
#: Seconds the harness gives one layout's run before it counts as a hang.
CASE_TIMEOUT = 60.0 + 3.0 * STEPS
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(int(CASE_TIMEOUT) + 120)]
#: Per-step chance that some rank injects a non-finite value; 0.25 keeps the scale drifting
#: slowly downwards (growth every 3 clean steps), so hundreds of steps stay in fp32's range.
P_INJECT = 0.25
P_DROP = 0.2
MODES = ("step", "step", "unscale", "clip", "stream")
#: No gradient here comes near it: clipping is a no-op, parity stays bitwise.
CLIP_LIMIT = 1e6
ROWS, DIM = 8, 8
SCALER_ARGS: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 3}
LAYOUTS = ["replicated", "fsdp2-1d", "fsdp-tp-2d"]
SEEDS = {"replicated": 11, "fsdp2-1d": 22, "fsdp-tp-2d": 33}


@dataclass(frozen=True)
class StepPlan:
    """What happens at one step, identical on every rank."""

    injections: tuple[tuple[int, int, float, float], ...]  # (rank, param, value, where in [0,1))
    drops: tuple[tuple[int, int], ...]  # (rank, param)
    mode: str  # "step", "unscale", "clip" or "stream"


def make_schedule(
    seed: int, steps: int, world: int, n_params: int, *, drops: bool
) -> list[StepPlan]:
    rng = random.Random(seed)
    plan = []
    for step in range(steps):
        injections = []
        if rng.random() < P_INJECT:
            for _ in range(rng.choice((1, 1, 2))):
                injections.append(
                    (
                        rng.randrange(world),
                        rng.randrange(n_params),
                        rng.choice((math.inf, -math.inf, math.nan)),
                        rng.random(),
                    )
                )
        dropped = []
        # Drops only in the second half: once a rank skipped a parameter's update the replicas
        # differ for good, and the first half checks that they stay bit-identical until then.
        if drops and rng.random() < P_DROP and step >= steps // 2:
            dropped.append((rng.randrange(world), rng.randrange(n_params)))
        plan.append(StepPlan(tuple(injections), tuple(dropped), rng.choice(MODES)))
    return plan


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.detach().full_tensor() if isinstance(p, DTensor) else p.detach().clone()


def _bits(x: float) -> bytes:
    return struct.pack("<f", x)


class _TPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(DIM, 16)
        self.down = nn.Linear(16, DIM)
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.down(torch.relu(self.up(x)))))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(DIM, 12), nn.Tanh(), nn.Linear(12, 6), nn.Tanh(), nn.Linear(6, 3)
    )


@dataclass
class _Summary:
    steps: int = 0
    skipped: int = 0
    injected_on: set[int] = field(default_factory=set)
    drops: int = 0
    max_param_err: float = 0.0


def _build(layout: str) -> tuple[nn.Module, nn.Module, Any, Any, Any]:
    """(model, reference, optimizer, reference optimizer, batch -> local batch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    if layout == "replicated":
        reference = _mlp()
        model = copy.deepcopy(reference)

        def sgd(m: nn.Module) -> torch.optim.Optimizer:
            return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

        return model, reference, sgd(model), sgd(reference), lambda b: b
    if layout == "fsdp2-1d":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        reference = _mlp()
        model = copy.deepcopy(reference)
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

        def adam(m: nn.Module) -> torch.optim.Optimizer:
            return torch.optim.Adam(m.parameters(), lr=1e-3, fused=True)

        return model, reference, adam(model), adam(reference), lambda b: b.chunk(world)[rank]
    assert layout == "fsdp-tp-2d"
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    reference = _TPBlock()
    model = copy.deepcopy(reference)
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model.up, mesh=mesh["dp"])
    fully_shard(model.down, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dp_rank = mesh.get_local_rank("dp")

    def sgd2(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    return model, reference, sgd2(model), sgd2(reference), lambda b: b.chunk(2)[dp_rank]


def _case_fuzz(layout: str, steps: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, reference, opt, ref_opt, local_batch = _build(layout)
    params, ref_params = list(model.parameters()), list(reference.parameters())
    n = len(params)
    schedule = make_schedule(SEEDS[layout], steps, world, n, drops=layout == "replicated")
    from shardscale.clip import StreamingStats, unscale_and_clip_

    scaler = ShardedGradScaler("cpu", backend="c10d", **SCALER_ARGS)
    ref_scaler = torch.amp.GradScaler("cpu", **SCALER_ARGS)
    stream = StreamingStats(params, scaler)
    observer = StepRecorder()
    registry = get_registry()
    name = registry.register(observer, name=f"fuzz-observer-{layout}")
    summary = _Summary()
    ever_dropped: set[int] = set()
    tol = 0.0 if layout == "replicated" else 1e-4
    try:
        for step, plan in enumerate(schedule):
            where = f"{layout} step {step} rank {rank} plan {plan}"
            batch = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1000 + step))
            opt.zero_grad()
            ref_opt.zero_grad()
            # StreamingStats reads gradients during backward, so in that mode the poison must
            # arrive there too: the injecting rank scales its loss by the value.
            poison = 1.0
            if plan.mode == "stream":
                poison = next((v for r, _, v, _ in plan.injections if r == rank), 1.0)
                if poison != 1.0:
                    summary.injected_on.add(rank)
            loss = model(local_batch(batch)).pow(2).mean() * poison
            scaler.scale(loss).backward()
            ref_scaler.scale(reference(batch).pow(2).mean()).backward()
            # Inject, then drop (a dropped gradient takes its injected value with it).
            for r, i, value, frac in plan.injections if plan.mode != "stream" else ():
                grad = params[i].grad
                if r == rank and grad is not None and _local(grad).numel():
                    flat = _local(grad).view(-1)
                    flat[int(frac * flat.numel())] = value
                    summary.injected_on.add(rank)
            for r, i in plan.drops:
                ever_dropped.add(i)
                if r == rank:
                    params[i].grad = None
                    ref_params[i].grad = None
                    summary.drops += 1
            injected = any(
                p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all())
                for p in params
            )
            truth_list: list[Any] = [None] * world
            dist.all_gather_object(truth_list, injected)  # the facts, straight through torch
            overflow = any(truth_list)
            if overflow:
                # The reference hears about an overflow anywhere through its own gradients.
                first = next(p for p in ref_params if p.grad is not None)
                first.grad.view(-1)[0] = math.inf
            if plan.mode == "unscale":
                scaler.unscale_(opt)
                ref_scaler.unscale_(ref_opt)
            elif plan.mode in ("clip", "stream"):
                norm = unscale_and_clip_(
                    scaler,
                    opt,
                    CLIP_LIMIT,
                    stats=stream if plan.mode == "stream" else None,
                    # Replicated: compared bit for bit with torch's recipe, which the multiply
                    # (the default) gives; the sharded layouts ask for SGD through torch's fused
                    # kernel (on the local shards), within their tolerance
                    # (tests/test_fused_optimizer.py derives the kernel's rounding-level bound).
                    fuse_optimizer=layout != "replicated",
                )
                ref_scaler.unscale_(ref_opt)
                ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, CLIP_LIMIT)
                assert math.isfinite(float(norm)) is math.isfinite(float(ref_norm)), where
            scaler.step(opt)
            ref_scaler.step(ref_opt)
            scaler.update()
            ref_scaler.update()

            record = observer.records[-1]
            skipped = bool(record.skipped)
            assert skipped == overflow, (
                f"{where}: skipped={skipped}, any rank overflowed={overflow}"
            )
            scale = scaler.get_scale()
            assert scale == ref_scaler.get_scale(), f"{where}: scale {scale} vs reference"
            seen: list[Any] = [None] * world
            dist.all_gather_object(seen, (skipped, _bits(scale)))
            assert len(set(seen)) == 1, f"{where}: ranks disagree: {seen}"
            for i, (p, q) in enumerate(zip(params, ref_params, strict=True)):
                full = _full(p)
                err = float((full - q.detach()).abs().max()) if full.numel() else 0.0
                summary.max_param_err = max(summary.max_param_err, err)
                assert err <= tol, f"{where}: param {i} differs from the reference by {err}"
                if layout == "replicated" and not ever_dropped:
                    copies: list[Any] = [None] * world
                    dist.all_gather_object(copies, full.view(-1).view(torch.int32).tolist())
                    assert all(c == copies[0] for c in copies), f"{where}: param {i} forked"
            summary.steps += 1
            summary.skipped += int(skipped)
    finally:
        registry.unregister(name)
        stream.remove()
    return {
        "steps": summary.steps,
        "skipped": summary.skipped,
        "injected_on": sorted(summary.injected_on),
        "drops": summary.drops,
        "max_param_err": summary.max_param_err,
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_takes_the_same_decision(pool4: Pool, layout: str) -> None:
    if layout != "replicated":
        pytest.importorskip("shardscale.fsdp")
    results = pool4.run(_case_fuzz, layout, STEPS, timeout=CASE_TIMEOUT)
    for res in results:
        assert isinstance(res, dict)
        assert res["steps"] == STEPS
        # The schedule really exercised both outcomes (and, replicated, dropped grads).
        assert 0 < res["skipped"] < STEPS
    assert len({r["skipped"] for r in results}) == 1  # type: ignore[index]
    injected_on = set().union(*(set(r["injected_on"]) for r in results))  # type: ignore[index]
    assert len(injected_on) >= 2, injected_on
    if layout == "replicated":
        assert sum(r["drops"] for r in results) > 0  # type: ignore[index]


def test_schedule_is_reproducible_and_varied() -> None:
    a = make_schedule(11, 200, 4, 6, drops=True)
    assert a == make_schedule(11, 200, 4, 6, drops=True)
    values = {v if not math.isnan(v) else "nan" for s in a for _, _, v, _ in s.injections}
    assert values == {math.inf, -math.inf, "nan"}
    assert {r for s in a for r, *_ in s.injections} == {0, 1, 2, 3}
    assert {s.mode for s in a} == set(MODES)
