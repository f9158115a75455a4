"""Turning an optimizer's (or any list of) parameters into buckets of local gradient tensors.

Shared by the scaler and the clipping package: one walk over the parameters,
each described by the adapter that claims it, grouped by (device, dtype) so the
stats kernels run once per group.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shardscale.core._errors import GradientDtypeError, LayoutError
from shardscale.core._protocols import AdapterContext

if TYPE_CHECKING:
    from shardscale.core._registry import Registry

__all__ = [
    "GradBuckets",
    "OwnerRefs",
    "Trace",
    "check_ranks",
    "collect_grads",
    "dtensor_type",
    "optimizer_params",
]


def dtensor_type() -> type[Any] | None:
    """torch's DTensor class, or None where torch is built without distributed support."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


_Key = tuple[torch.device, torch.dtype]


@dataclass(slots=True)
class GradBuckets:
    """Local gradient tensors grouped by (device, dtype).

    ``every`` holds every local tensor (each must be unscaled/clipped);
    ``counted`` only those whose copy on this rank contributes to global sums.
    ``owners`` and ``counts_mask`` run parallel to ``every``: the parameter
    each tensor belongs to, and whether it is in ``counted``.
    """

    every: dict[_Key, list[torch.Tensor]] = field(default_factory=dict)
    counted: dict[_Key, list[torch.Tensor]] = field(default_factory=dict)
    owners: dict[_Key, list[torch.Tensor]] = field(default_factory=dict)
    counts_mask: dict[_Key, list[bool]] = field(default_factory=dict)
    count: int = 0

    def params(self) -> list[torch.Tensor]:
        """Every parameter (or gradient) that contributed a local tensor."""
        return [p for owners in self.owners.values() for p in owners]

    def owner_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, local tensor) pairs in bucket order, the order the engine reads them."""
        return [
            (owner, t)
            for key, tensors in self.every.items()
            for owner, t in zip(self.owners[key], tensors, strict=True)
        ]

    def devices(self) -> list[torch.device]:
        """Devices that hold at least one local gradient, in first-seen order."""
        seen: dict[torch.device, None] = {}
        for device, _ in self.every:
            seen.setdefault(device, None)
        return list(seen)


_Refs = tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]


class OwnerRefs(Collection[_Refs]):
    """(parameter, local tensor) weak references in bucket order, kept as two columns.

    A step keeps them for overflow localisation. Two lists of plain weak
    references (CPython shares one per tensor) instead of one tuple per
    tensor: with 10^4 parameters, 10^4 tuples per step kept past the step
    were enough to set off full garbage collections of the whole heap.
    """

    __slots__ = ("params", "tensors")

    def __init__(
        self, params: list[weakref.ref[torch.Tensor]], tensors: list[weakref.ref[torch.Tensor]]
    ) -> None:
        if len(params) != len(tensors):
            raise ValueError(f"{len(params)} parameter references for {len(tensors)} tensors")
        self.params = params
        self.tensors = tensors

    @classmethod
    def of(cls, params: Iterable[torch.Tensor], tensors: Iterable[torch.Tensor]) -> OwnerRefs:
        """References to ``params`` and ``tensors`` (parallel iterables)."""
        return cls(list(map(weakref.ref, params)), list(map(weakref.ref, tensors)))

    def __len__(self) -> int:
        return len(self.params)

    def __iter__(self) -> Iterator[_Refs]:
        return zip(self.params, self.tensors, strict=True)

    def __contains__(self, item: object) -> bool:
        return any(pair == item for pair in self)


@dataclass(slots=True)
class Trace:
    """How a walk found its local tensors, for the step plan (``_step_plan``) to learn from.

    Columns, one entry per local tensor in walk order: ``positions`` (its
    parameter's position in the list walked) and ``locals``; ``stable``:
    every adapter asked promised a stable answer (``stable_layout = True``);
    ``members``: per bucket, the indices into ``locals`` of its tensors, in
    bucket order (None: the plan computes them).
    """

    positions: list[int] = field(default_factory=list)
    locals: list[torch.Tensor] = field(default_factory=list)
    stable: bool = True
    members: dict[_Key, list[int]] | None = None


def optimizer_params(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    """Every parameter of every param group of ``optimizer``."""
    for group in optimizer.param_groups:
        yield from group["params"]


#: (id(ranks), id(group ranks)) -> (ranks, group ranks, whether the first lie in the second).
_WITHIN: collections.OrderedDict[tuple[int, int], tuple[frozenset[int], tuple[int, ...], bool]] = (
    collections.OrderedDict()
)


def _within(ranks: frozenset[int], group_ranks: tuple[int, ...]) -> bool:
    """Whether ``ranks`` all lie in ``group_ranks``, O(W) once per pair of objects.

    A mesh's ranks (cached by the adapter) and a group's (cached by the
    backend) are the same objects step after step: at 10^5 ranks a set test
    per parameter and step cost more than the step (docs/benchmark.md).
    """
    key = (id(ranks), id(group_ranks))
    hit = _WITHIN.get(key)
    if hit is not None and hit[0] is ranks and hit[1] is group_ranks:
        return hit[2]
    ok = ranks <= frozenset(group_ranks)
    _WITHIN[key] = (ranks, group_ranks, ok)  # holding both: their ids stay theirs
    if len(_WITHIN) > 64:
        _WITHIN.popitem(last=False)
    return ok


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
    from shardscale.core.step._layout_groups import collect_by_layout  # it builds on this module

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
                known = stable_of[id(adapter)] = (
                    getattr(type(adapter), "stable_layout", False) is True
                )
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


def check_ranks(
    ranks: frozenset[int] | None, group_ranks: tuple[int, ...] | None, param: torch.Tensor
) -> None:
    """Refuse a gradient that lives on ranks outside the reduction group."""
    if ranks is None or group_ranks is None or _within(ranks, group_ranks):
        return
    allowed = frozenset(group_ranks)
    raise LayoutError(
        f"a gradient of shape {tuple(param.shape)} lives on ranks {sorted(ranks)}, but the "
        f"reduction group holds only ranks {sorted(allowed)} (missing "
        f"{sorted(ranks - allowed)}). Pass process_group=... covering every rank that holds "
        "these parameters (the default group usually does)."
    )
