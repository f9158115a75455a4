"""Describing gradients once per layout, not once per parameter: the cold step's bulk walk.

[Note: one answer per layout]
A cold step (no step plan yet) used to ask each parameter's adapter to
describe its gradient: with thousands of small FSDP2 parameters that per-
parameter Python was most of the step. But an adapter that promises
``stable_layout`` answers ``counts`` and ``ranks`` from a few facts shared by
many parameters (a DTensor's mesh and placements; for a plain tensor, whether
it is declared distinct), and its ``local`` is the gradient itself or a
DTensor gradient's ``_local_tensor``. Such an adapter may also say, in bulk,
which parameters share those facts: ``layout_keys(params, grads, ctx)``
returns one hashable key per parameter, built with C-level ``map``/``zip``,
equal keys promising equal answers. Then:

* parameters are routed to adapters once per parameter class where every
  adapter can answer by class (``claims_type``), else per parameter, as the
  walk does;
* each adapter's parameters are grouped by its key (a group whose gradients
  are of several classes takes the walk); ``describe`` is called on one
  member per group and its ``counts`` and
  ``ranks`` (checked against the reduction group once) are reused for every
  member; the locals are taken in bulk, after checking that the member asked
  gave exactly the tensor the promise says;
* the buckets come from torch's C++ grouping by (device, dtype), in the
  walk's first-seen order, and each bucket's dtype is checked once.

Every check the walk makes is still made, once per group instead of once per
parameter. Anything unusual -- a sparse gradient, an item that is no tensor,
an adapter without keys, any error at all -- returns None, and the caller
takes the walk (``_gradients._collect_each``), which asks every parameter
and raises exactly as it always did.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from shardscale.core._protocols import AdapterContext, layout_keys_of, promises_stable_layout
from shardscale.core.step._buckets import GradBuckets, Trace, check_ranks, dtensor_type

if TYPE_CHECKING:
    from shardscale.core._registry import Registry

__all__ = ["collect_by_layout", "positions_by"]

_GRAD = operator.attrgetter("grad")
_LOCAL = operator.attrgetter("_local_tensor")
_SPARSE = operator.attrgetter("is_sparse")
_Key = tuple[torch.device, torch.dtype]


def positions_by(keys: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """The positions of each distinct key, keys in first-seen order, positions ascending."""
    distinct = dict.fromkeys(keys)
    if len(distinct) == 1:  # the common case: one layout, no per-item loop
        return {next(iter(distinct)): list(range(len(keys)))}
    out: dict[Hashable, list[int]] = {key: [] for key in distinct}
    for position, key in enumerate(keys):
        out[key].append(position)
    return out


def _pick(items: Sequence[Any], positions: Sequence[int]) -> list[Any]:
    return list(map(items.__getitem__, positions))


def collect_by_layout(
    params: list[torch.Tensor],
    ctx: AdapterContext,
    registry: Registry,
    *,
    group_ranks: tuple[int, ...] | None,
    as_grads: bool,
    trace: Trace | None,
) -> GradBuckets | None:
    """``collect_grads``' answer, one adapter call per layout; None: take the walk.

    See [Note: one answer per layout].
    """
    try:
        return _collect(
            params, ctx, registry, group_ranks=group_ranks, as_grads=as_grads, trace=trace
        )
    except Exception:
        return None  # the walk asks each parameter and raises the error it always raised


def _collect(
    params: list[torch.Tensor],
    ctx: AdapterContext,
    registry: Registry,
    *,
    group_ranks: tuple[int, ...] | None,
    as_grads: bool,
    trace: Trace | None,
) -> GradBuckets | None:
    if not params or not all(issubclass(kind, torch.Tensor) for kind in set(map(type, params))):
        return None
    grads: list[Any] = params if as_grads else list(map(_GRAD, params))
    present = list(
        itertools.compress(range(len(grads)), map(operator.is_not, grads, itertools.repeat(None)))
    )
    if len(present) != len(grads):
        params, grads = _pick(params, present), _pick(grads, present)
    if not grads or any(map(_SPARSE, grads)):
        return None  # nothing to describe, or sparse values to coalesce: the walk
    count = len(grads)
    locals_: list[Any] = [None] * count
    counts: list[bool] = [False] * count
    stable = True
    dtensor = dtensor_type()
    for adapter, members in _by_adapter(params, registry).items():
        stable = stable and promises_stable_layout(adapter)
        sub_params, sub_grads = _pick(params, members), _pick(grads, members)
        keys_of = layout_keys_of(adapter)
        keys = keys_of(sub_params, sub_grads, ctx) if keys_of is not None else None
        if keys is None:  # an adapter that cannot group: asked per parameter
            for position, param, grad in zip(members, sub_params, sub_grads, strict=True):
                shard = adapter.describe(param, grad, ctx)
                check_ranks(shard.ranks, group_ranks, param)
                locals_[position], counts[position] = shard.local, bool(shard.counts)
            continue
        for group in positions_by(keys).values():
            first = group[0]
            grad = sub_grads[first]
            group_grads = _pick(sub_grads, group)
            if len(set(map(type, group_grads))) != 1:
                return None  # one layout, gradients of several classes: ask each parameter
            shard = adapter.describe(sub_params[first], grad, ctx)
            check_ranks(shard.ranks, group_ranks, sub_params[first])
            is_dtensor = dtensor is not None and isinstance(grad, dtensor)
            if shard.local is not (grad._local_tensor if is_dtensor else grad):
                return None  # not what stable_layout promises: ask each parameter
            group_locals = list(map(_LOCAL, group_grads)) if is_dtensor else group_grads
            answer = bool(shard.counts)
            if len(group) == count:  # one adapter, one layout: the whole list at once
                locals_, counts = group_locals, [answer] * count
                continue
            for index, local in zip(group, group_locals, strict=True):
                locals_[members[index]] = local
                counts[members[index]] = answer
    return _buckets(params, locals_, counts, present, stable, trace)


def _by_adapter(params: list[torch.Tensor], registry: Registry) -> dict[Any, list[int]]:
    """Each adapter's parameters (positions), by class where every adapter can say by class."""
    kinds = list(map(type, params))
    by_kind = {kind: registry.adapter_for_type(kind) for kind in set(kinds)}
    if len(by_kind) == 1 and None not in by_kind.values():
        return {next(iter(by_kind.values())): list(range(len(params)))}
    adapters = [
        by_kind[kind] or registry.adapter_for(p) for kind, p in zip(kinds, params, strict=True)
    ]
    grouped = positions_by(list(map(id, adapters)))
    return {adapters[positions[0]]: positions for positions in grouped.values()}


def _buckets(
    params: list[torch.Tensor],
    locals_: list[torch.Tensor],
    counts: list[bool],
    present: list[int],
    stable: bool,
    trace: Trace | None,
) -> GradBuckets | None:
    # torch's C++ grouping by (device, dtype), with each tensor's position; the walk's bucket
    # order is the order in which each key first appears.
    grouped: dict[_Key, Any] = torch._C._group_tensors_by_device_and_dtype(
        [cast("list[torch.Tensor | None]", locals_)], True
    )
    buckets = GradBuckets()
    members: dict[_Key, list[int]] = {}
    for key in sorted(grouped, key=lambda k: int(grouped[k][1][0])):
        if not key[1].is_floating_point:
            return None  # the walk names the parameter
        tensors: list[torch.Tensor] = list(grouped[key][0][0])
        positions = list(grouped[key][1])
        mask = _pick(counts, positions)
        buckets.every[key] = tensors
        buckets.owners[key] = _pick(params, positions)
        buckets.counts_mask[key] = mask
        if all(mask):
            buckets.counted[key] = tensors
        elif any(mask):
            buckets.counted[key] = list(itertools.compress(tensors, mask))
        members[key] = positions
    buckets.count = len(locals_)
    if trace is not None:
        trace.positions, trace.locals, trace.stable, trace.members = (
            present,
            locals_,
            stable,
            members,
        )
    return buckets
