"""Turning an optimizer's (or any list of) parameters into buckets of local gradient tensors.

Shared by the scaler and the clipping package: one walk over the parameters,
each described by the adapter that claims it, grouped by (device, dtype) so the
stats kernels run once per group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from shardscale.core._errors import GradientDtypeError
from shardscale.core._protocols import AdapterContext, promises_stable_layout

if TYPE_CHECKING:
    from shardscale.core._registry import Registry

from shardscale.core.step._buckets import GradBuckets, Trace, _Key, check_ranks
from shardscale.core.step._layout_groups import collect_by_layout

__all__ = ["collect_grads"]


def collect_grads(
    params: Iterable[torch.Tensor],
    ctx: AdapterContext,
    registry: Registry,
    *,
    group_ranks: tuple[int, ...] | None,
    coalesce_sparse: bool = True,
    as_grads: bool = False,
    trace: Trace | None = None,
) -> GradBuckets:
    """Describe each parameter's gradient through its adapter and bucket the local data.

    Parameters without a gradient are skipped (other ranks may have one: the
    reduction still happens on every rank, so nobody waits forever). Sparse
    gradients contribute their values; fp16 sparse gradients are coalesced first,
    as torch's GradScaler does, so duplicate indices cannot overflow separately.
    With ``as_grads=True`` each item is itself a gradient (``get_total_norm``
    takes gradients, not parameters) and is described by the adapter that
    claims its type; sparse ones are then coalesced without being stored back.
    ``trace``, when given, receives where each local tensor came from.

    Parameters whose adapters can say which of them share a layout
    (``layout_keys``, see [Note: one answer per layout]) are described once
    per layout, in bulk; anything unusual (sparse gradients, a problem to
    report) takes the walk that asks each parameter's adapter, which names
    the problem exactly as it always did.
    """
    params = params if isinstance(params, list) else list(params)
    bulk = collect_by_layout(
        params, ctx, registry, group_ranks=group_ranks, as_grads=as_grads, trace=trace
    )
    if bulk is not None:
        return bulk
    if trace is not None:  # the walk starts the trace afresh
        trace.positions, trace.locals, trace.stable, trace.members = [], [], True, None
    return _collect_each(
        params,
        ctx,
        registry,
        group_ranks=group_ranks,
        coalesce_sparse=coalesce_sparse,
        as_grads=as_grads,
        trace=trace,
    )


def _collect_each(
    params: Iterable[torch.Tensor],
    ctx: AdapterContext,
    registry: Registry,
    *,
    group_ranks: tuple[int, ...] | None,
    coalesce_sparse: bool,
    as_grads: bool,
    trace: Trace | None,
) -> GradBuckets:
    """The walk: each parameter's adapter asked in turn (the reference the bulk path must match)."""
    buckets = GradBuckets()
    stable_of: dict[int, bool] = {}  # id(adapter) -> stable_layout, asked once per step
    by_key: dict[_Key, tuple[list[torch.Tensor], list[torch.Tensor], list[bool]]] = {}
    for position, param in enumerate(params):
        if not isinstance(param, torch.Tensor):
            raise TypeError(
                f"expected parameters to be tensors, got {type(param).__name__}; pass "
                "model.parameters() or the optimizer's parameters"
            )
        grad = param if as_grads else param.grad
        if grad is None:
            continue
        if grad.is_sparse:
            if coalesce_sparse and grad.dtype is torch.float16:
                grad = grad.coalesce()
                if not as_grads:
                    param.grad = grad
            local = grad._values()
            counts = ctx.rank == 0 or "*" in ctx.distinct_dims or id(param) in ctx.distinct_params
            stable = False
        else:
            adapter = registry.adapter_for(param)
            known = stable_of.get(id(adapter))
            if known is None:
                known = stable_of[id(adapter)] = promises_stable_layout(adapter)
            stable = known
            shard = adapter.describe(param, grad, ctx)
            local, counts = shard.local, shard.counts
            check_ranks(shard.ranks, group_ranks, param)
        if not local.dtype.is_floating_point:  # complex and integer dtypes alike
            raise GradientDtypeError(
                f"gradients must be real floating point, got {local.dtype} for a parameter of "
                f"shape {tuple(param.shape)}; mixed precision scaling and norm clipping only "
                "apply to float16/bfloat16/float32/float64 parameters"
            )
        key = (local.device, local.dtype)
        lists = by_key.get(key)
        if lists is None:
            lists = by_key[key] = (
                buckets.every.setdefault(key, []),
                buckets.owners.setdefault(key, []),
                buckets.counts_mask.setdefault(key, []),
            )
        lists[0].append(local)
        lists[1].append(param)
        lists[2].append(bool(counts))
        if counts:
            buckets.counted.setdefault(key, []).append(local)
        buckets.count += 1
        if trace is not None:
            trace.positions.append(position)
            trace.locals.append(local)
            trace.stable = trace.stable and stable
    return buckets
