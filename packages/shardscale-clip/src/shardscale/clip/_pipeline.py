"""The shared steps of every clip call: collect, read once, reduce once, finish.

[Note: one vector, one collective]
Each rank reads the gradients it *counts* once and produces two numbers: its
partial statistic (Σ|g|^p, or max|g| for the inf-norm) and a flag that is 1
when that partial is not finite. Both travel in one float32 vector through ONE
all-reduce over the reduction group (SUM for finite p, MAX for inf; a flag
survives either). The flag is what decides overflow, never the reduced
partial itself: a MAX reduction is free to drop a nan, a flag of 1 cannot be
dropped. A non-finite gradient anywhere makes its rank's partial non-finite,
so the overflow check rides on the same read as the norm.

[Note: when the partial overflows]
Σ|g|^p is accumulated in float32. If it overflows although every gradient is
finite (huge gradients, a large p, a large loss scale), the partial is inf and
the step is treated as an overflow: with a scaler the step is skipped and the
scale backs off until the sum fits, which is the same remedy as for an fp16
overflow in backward. torch would instead take a step with a clip coefficient
of 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardscale.core import (
    AdapterContext,
    CollectiveBackend,
    GradBuckets,
    ReduceOp,
    Registry,
    collect_grads,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "EPS",
    "Reduction",
    "clip_coefficient",
    "collect",
    "group_ranks",
    "kernels_name",
    "local_partial",
    "multiply_",
    "reduce_partial",
    "root",
]

#: Added to the norm before dividing, as torch's clip_grad_norm_ does.
EPS = 1e-6

_Key = tuple[torch.device, torch.dtype]


def kernels_name(foreach: bool | None, kernels: str | None) -> str | None:
    """Which stats kernels to ask the registry for (``None``: the best for the device).

    An explicit ``foreach`` wins over a scaler's configured kernels, as it is
    the more specific request: True means the multi-tensor kernels, False the
    per-tensor loop.
    """
    if foreach is None:
        return kernels
    if not isinstance(foreach, bool):
        raise TypeError(f"foreach must be True, False or None, got {foreach!r}")
    return "foreach" if foreach else "loop"


def group_ranks(backend: CollectiveBackend, group: ProcessGroup | None) -> tuple[int, ...] | None:
    """Global ranks of the reduction group, or ``None`` outside a distributed run."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return backend.group_ranks(group)


def adapter_context(
    backend: CollectiveBackend, group: ProcessGroup | None, distinct_dims: Iterable[str]
) -> AdapterContext:
    """What adapters need to know about the reduction group of a clip call."""
    if isinstance(distinct_dims, str):
        raise TypeError(
            f"distinct_dims takes an iterable of mesh dimension names, got the string "
            f"{distinct_dims!r}; write distinct_dims=({distinct_dims!r},)"
        )
    return AdapterContext(
        group=group,
        distinct_dims=frozenset(distinct_dims),
        rank=backend.rank(group),
        world_size=backend.world_size(group),
    )


def collect(
    items: Iterable[torch.Tensor],
    ctx: AdapterContext,
    registry: Registry,
    backend: CollectiveBackend,
    *,
    as_grads: bool,
) -> GradBuckets:
    """Describe every gradient through its adapter (``as_grads``: items are gradients).

    Sparse gradients are coalesced first: a norm over uncoalesced values would
    count duplicate indices separately (|a|^2 + |b|^2 instead of |a + b|^2).
    """
    return collect_grads(
        _coalesced(items, as_grads=as_grads),
        ctx,
        registry,
        group_ranks=group_ranks(backend, ctx.group),
        as_grads=as_grads,
    )


def _coalesced(items: Iterable[torch.Tensor], *, as_grads: bool) -> list[torch.Tensor]:
    out = []
    for item in items:
        grad = item if as_grads else getattr(item, "grad", None)
        if isinstance(grad, torch.Tensor) and grad.is_sparse and not grad.is_coalesced():
            if as_grads:
                out.append(grad.coalesce())  # the caller's tensor is only read: a copy will do
                continue
            item.grad = grad.coalesce()  # as torch's GradScaler does for fp16 sparse grads
        out.append(item)
    return out


def local_partial(
    counted: Mapping[_Key, Sequence[torch.Tensor]],
    norm_type: float,
    registry: Registry,
    kernels: str | None,
    device: torch.device,
) -> torch.Tensor:
    """This rank's Σ|g|^p (or max|g|) over the gradients it counts, a float32 on ``device``."""
    parts = []
    for (dev, _dtype), tensors in counted.items():
        if tensors:
            part = registry.kernels_for(dev, kernels).partial_norm(tensors, norm_type)
            parts.append(part.to(device=device, dtype=torch.float32, non_blocking=True))
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=device)
    if len(parts) == 1:
        return parts[0].reshape(())
    stacked = torch.stack([p.reshape(()) for p in parts])
    return stacked.max() if math.isinf(norm_type) else stacked.sum()


@dataclass(frozen=True, slots=True)
class Reduction:
    """The globally reduced statistics: every field is a 0-dim float32 tensor."""

    partial: torch.Tensor
    nonfinite: torch.Tensor


def reduce_partial(
    partial: torch.Tensor,
    norm_type: float,
    backend: CollectiveBackend,
    group: ProcessGroup | None,
) -> Reduction:
    """Combine every rank's partial and non-finite flag in ONE all-reduce (see the note above)."""
    flag = (~torch.isfinite(partial)).to(torch.float32)
    vec = torch.stack([partial.to(torch.float32), flag])
    op = ReduceOp.MAX if math.isinf(norm_type) else ReduceOp.SUM
    backend.all_reduce(vec, op=op, group=group).wait()
    return Reduction(partial=vec[0], nonfinite=vec[1] > 0)


def root(partial: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The p-th root that turns a reduced Σ|g|^p into a norm (identity for 1 and inf)."""
    if math.isinf(norm_type) or norm_type == 1.0:
        return partial
    if norm_type == 2.0:
        return partial.sqrt()
    return partial.pow(1.0 / norm_type)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)), computed on device without a host sync."""
    return (max_norm / (norm + EPS)).clamp(max=1.0)


def multiply_(
    every: Mapping[_Key, Sequence[torch.Tensor]],
    factor: torch.Tensor,
    registry: Registry,
    kernels: str | None,
) -> None:
    """Multiply every local gradient in place by the 0-dim ``factor`` (one R+W pass)."""
    for (dev, _dtype), tensors in every.items():
        if tensors:
            registry.kernels_for(dev, kernels).mul_(tensors, factor.to(dev, non_blocking=True))
