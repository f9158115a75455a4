"""Shared pieces of the ``test_scaler_*`` integration tests; this module holds no tests.

Every scenario is trained twice on each rank: the sharded model with
:class:`~shardscale.core.ShardedGradScaler` on this rank's share of each
batch, and an unsharded reference model with ``torch.amp.GradScaler("cpu")``
on the whole batch. At :data:`INF_STEP` one element of one local gradient is
set to inf on :data:`inf_rank` only (and anywhere in the reference): every
rank must skip that step and back off, as the reference does. A case returns a
:class:`Summary` and the test (in the parent process) checks it with
:func:`assert_matches_reference`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardscale.collectives import CountingMiddleware, find_middleware
from shardscale.core import AdapterContext, ShardedGradScaler, get_registry
from shardscale.core.step import collect_grads

__all__ = [
    "IN_DIM",
    "INF_STEP",
    "SCALER_ARGS",
    "STEPS",
    "Summary",
    "assert_matches_reference",
    "counted_sq_norm",
    "full_params",
    "global_batches",
    "inf_rank",
    "inject_inf",
    "mlp",
    "run_against_reference",
    "torch_steps",
    "train",
]

STEPS = 5
INF_STEP = 2
IN_DIM = 8
#: A small growth interval so the scale also grows within the few steps.
SCALER_ARGS: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 2}


def inf_rank() -> int:
    """The one rank that sees the injected inf: the last, so rank 0 cannot decide alone."""
    return dist.get_world_size() - 1


def mlp(*, seed: int = 0, hidden: int = 16, out: int = 4) -> nn.Sequential:
    """A few Linear layers; sizes chosen so that shards are uneven on 4 ranks."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_DIM, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, out),
    )


def global_batches(rows: int, *, steps: int = STEPS, dim: int = IN_DIM) -> list[torch.Tensor]:
    """The same batches on every rank."""
    gen = torch.Generator().manual_seed(1234)
    return [torch.randn(rows, dim, generator=gen) for _ in range(steps)]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def inject_inf(params: Iterable[torch.Tensor]) -> None:
    """Set one element of the first non-empty local gradient to inf."""
    for p in params:
        if p.grad is not None and _local(p.grad).numel():
            _local(p.grad).view(-1)[-1] = float("inf")
            return
    raise AssertionError("no local gradient to inject an inf into")


def counted_sq_norm(params: Iterable[torch.Tensor], *, distinct_dims: Iterable[str] = ()) -> float:
    """Σ|g|² over the gradients the adapters say count here, summed over all ranks.

    Equal to the reference's Σ|g|² only if every logical element is counted
    exactly once: this checks the adapters' ``counts`` in each layout.
    """
    ctx = AdapterContext(
        group=None,
        distinct_dims=frozenset(distinct_dims),
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
    )
    buckets = collect_grads(
        params, ctx, get_registry(), group_ranks=tuple(range(dist.get_world_size()))
    )
    total = torch.zeros((), dtype=torch.float64)
    for tensors in buckets.counted.values():
        for t in tensors:
            total += t.detach().double().pow(2).sum()
    dist.all_reduce(total)  # straight through torch: not counted as a scaler collective
    return float(total)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full plain tensor, under its unwrapped name (collective for DTensors)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        clean = name.replace("_fsdp_wrapped_module.", "").removeprefix("module.")
        out[clean] = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach().clone()
    return out


@dataclass
class _Run:
    losses: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    collectives: list[int] = field(default_factory=list)
    sq_norms: list[float] = field(default_factory=list)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: ShardedGradScaler | torch.amp.GradScaler,
    batches: Sequence[torch.Tensor],
    *,
    loss_of: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    inject: Callable[[], None] | None,
    unscale: bool = False,
    sq_norm: Callable[[], float] | None = None,
    average_loss: bool = False,
    after_backward: Callable[[int], None] | None = None,
) -> _Run:
    """The usual AMP loop; records loss, scale and (for ours) scaler collectives per step."""
    counter: CountingMiddleware | None = None
    if isinstance(scaler, ShardedGradScaler):
        counter = find_middleware(scaler.backend, CountingMiddleware)
    run = _Run()
    for step, batch in enumerate(batches):
        if counter is not None:
            counter.reset()
        loss = loss_of(model, batch)
        scaler.scale(loss).backward()
        if after_backward is not None:
            after_backward(step)
        if step == INF_STEP and inject is not None:
            inject()
        if unscale:
            scaler.unscale_(optimizer)
            if sq_norm is not None:
                run.sq_norms.append(sq_norm() if step != INF_STEP else math.nan)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if counter is not None:
            run.collectives.append(len(counter.records))
            assert all(r.group_size == dist.get_world_size() for r in counter.records)
        value = loss.detach().clone()
        if average_loss:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        run.losses.append(float(value))
        run.scales.append(scaler.get_scale())
    return run


@dataclass(frozen=True)
class Summary:
    """What one rank saw, returned to the parent process."""

    scales: list[float]
    ref_scales: list[float]
    collectives: list[int]
    loss_err: float
    param_err: float
    norm_err: float
    extra: dict[str, Any] = field(default_factory=dict)


def torch_steps(scaler: torch.amp.GradScaler, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """torch's recipe for several optimizers, once each was unscaled or clipped: ``scaler.step``
    each, ONE ``update()``, then zero the gradients. True when the scale backed off (skipped)."""
    before = scaler.get_scale()
    for opt in optimizers:
        scaler.step(opt)
    scaler.update()
    for opt in optimizers:
        opt.zero_grad()
    return scaler.get_scale() < before


def _max_err(a: Sequence[float], b: Sequence[float]) -> float:
    errs = [abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b, strict=True) if not math.isnan(y)]
    return max(errs, default=0.0)


def run_against_reference(
    model: nn.Module,
    reference: nn.Module,
    *,
    shard_of: Callable[[torch.Tensor], torch.Tensor],
    rows: int,
    make_opt: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer] | None = None,
    loss_of: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    unscale: bool = False,
    distinct_dims: Iterable[str] = (),
    params: Callable[[nn.Module], list[torch.Tensor]] | None = None,
    full: Callable[[nn.Module], dict[str, torch.Tensor]] = full_params,
    after_backward: Callable[[int], None] | None = None,
    inject: bool = True,
    loss_factor: float = 1.0,
) -> Summary:
    """Train ``model`` (sharded) and ``reference`` (whole) on the same data and compare.

    ``shard_of`` picks this rank's rows of a global batch. ``params`` picks the
    optimizer's parameters (default: all of the model's). The mean of the
    ranks' losses times ``loss_factor`` is compared with the reference's loss.
    """
    make_opt = make_opt or (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    loss_of = loss_of or (lambda m, x: m(x).pow(2).mean())
    pick = params or (lambda m: list(m.parameters()))
    distinct = tuple(distinct_dims)
    ours_params = pick(model)
    scaler = ShardedGradScaler(
        "cpu", backend="counting+c10d", distinct_dims=distinct, **SCALER_ARGS
    )
    batches = global_batches(rows)
    ref_params = list(reference.parameters())
    ref = train(
        reference,
        make_opt(ref_params),
        torch.amp.GradScaler("cpu", **SCALER_ARGS),
        batches,
        loss_of=loss_of,
        inject=(lambda: inject_inf(ref_params)) if inject else None,
        unscale=unscale,
        sq_norm=lambda: float(
            sum(p.grad.double().pow(2).sum() for p in ref_params if p.grad is not None)
        ),
    )
    ours = train(
        model,
        make_opt(ours_params),
        scaler,
        [shard_of(b) for b in batches],
        loss_of=loss_of,
        inject=(lambda: inject_inf(ours_params))
        if inject and dist.get_rank() == inf_rank()
        else None,
        unscale=unscale,
        sq_norm=lambda: counted_sq_norm(ours_params, distinct_dims=distinct),
        average_loss=True,
        after_backward=after_backward,
    )
    got, expected = full(model), full_params(reference)
    assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
    param_err = max(float((got[k] - v).abs().max()) for k, v in expected.items() if v.numel())
    return Summary(
        scales=ours.scales,
        ref_scales=ref.scales,
        collectives=ours.collectives,
        loss_err=_max_err([x * loss_factor for x in ours.losses], ref.losses),
        param_err=param_err,
        norm_err=_max_err(ours.sq_norms, ref.sq_norms),
    )


def assert_matches_reference(results: Sequence[Summary], *, tol: float = 1e-5) -> None:
    """Every rank: the reference's scales, losses and parameters, one collective per step."""
    first = results[0]
    assert first.scales == first.ref_scales, (first.scales, first.ref_scales)
    assert first.scales[INF_STEP] < first.scales[INF_STEP - 1], "the injected inf did not back off"
    for rank, summary in enumerate(results):
        assert summary.scales == first.scales, f"rank {rank} disagrees: {summary.scales}"
        assert summary.collectives == [1] * STEPS, f"rank {rank}: {summary.collectives}"
        assert summary.loss_err < tol, f"rank {rank}: loss error {summary.loss_err}"
        assert summary.param_err < tol, f"rank {rank}: parameter error {summary.param_err}"
        assert summary.norm_err < tol, f"rank {rank}: Σ|g|² error {summary.norm_err}"
