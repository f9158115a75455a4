"""The step plan: what the collect and check stages found, kept per layout for the next step.

[Note: the step plan]
A step's collect and check stages ask, per parameter, which adapter owns its
gradient, which copy counts, which bucket (device, dtype) it falls in, and
whether the declarations fit the parameters. With thousands of small
parameters (MoE experts) that Python work costs more than reading the
gradients. None of it changes from one step to the next unless the layout
does, so the first step on a layout keeps its answers in a :class:`StepPlan`
and later steps check, in bulk, that they still hold:

* the same parameters, in the same order: the plan holds each one, and each
  must be exactly (``is``) the tensor of the step (held, none can be freed
  and have a new tensor take its address);
* each gradient's presence and class: ``type(grad)`` per parameter (``None``
  when absent), no plain gradient turned sparse, each DTensor gradient's
  ``_spec`` equal to the one the plan was built for (its mesh, placements
  and global shape: what the adapter's ``counts`` answer rests on);
* each local tensor's (device, dtype): the bucket keys and their members are
  recomputed by torch's C++ grouping and must equal the plan's, in order;
* the step's configuration (group and its ranks, rank, world, distinct dims
  and tensors, registry catalog, sparse coalescing): part of the plan's key.

Then the local tensors are taken directly (a DTensor gradient's
``_local_tensor``, a plain gradient itself): no adapter call, no registry
lookup, no per-parameter bookkeeping. Anything else is a rebuild: the step
runs cold, exactly as without a plan, and the new plan replaces the old one.

What is still checked on every step, plan or not: the aliasing of gradients
(their addresses can change with every new gradient), the devices against the
scale's, the options, the kernels, and the declarations' fingerprint of the
plain replicated tensors (their shapes and dtypes are re-read). A plan is
kept only after a step whose checks all passed; only adapters that declare
``stable_layout = True`` (their answer depends on nothing but the gradient's
layout and the step's context: the built-in ones) are planned; a step with
any other adapter, or with sparse gradients, always runs cold.

Who keeps a plan: the caller that steps the same tensors again, through a
:class:`StepPlans` it owns and passes in ``StepRequest.plans`` (the scaler
keeps one per optimizer, keyed weakly on the optimizer, so a plan lives no
longer than the optimizer that holds the same parameters). A call without one
(the clip functions) runs cold and keeps nothing. A plan holds its parameters
through plain references, never weak ones: torch's ``swap_tensors`` (what
``module.to()`` does to DTensor parameters, and to every parameter under
``torch.__future__.set_swap_module_params_on_conversion``) refuses a tensor
with a weak reference, and a Python reference does not count against its
use-count check. Gradients it holds not at all.
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from shardscale.core.step._arith import StepScratch
from shardscale.core.step._buckets import GradBuckets, Trace, dtensor_type

__all__ = [
    "StepPlan",
    "StepPlans",
    "build_plan",
    "replicas_unchanged",
    "warm_buckets",
]

_GRAD = operator.attrgetter("grad")
_SPEC = operator.attrgetter("_spec")
_LOCAL = operator.attrgetter("_local_tensor")
_SPARSE = operator.attrgetter("is_sparse")
_Key = tuple[torch.device, torch.dtype]


@dataclass(slots=True, eq=False)
class _PlanBucket:
    key: _Key
    #: Positions in the list of present gradients, in bucket order.
    members: list[int]
    #: Positions of the owners in the step's tensor list (None: the list itself).
    owners: list[int] | None
    counts: list[bool]
    #: Indices of the counted members, per device they were asked on (built once).
    counted_index: dict[torch.device, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class StepPlan:
    """The answers of one cold step's collect and check stages (see [Note: the step plan])."""

    key: Hashable
    catalog: object
    #: The tensors of the step, in order (plain references: see the note).
    params: list[torch.Tensor]
    grad_types: list[type]
    #: Positions of the tensors that have a gradient (None: all of them).
    present: list[int] | None
    #: Per present gradient, whether it is a DTensor (local: ``_local_tensor``).
    dtensor: list[bool]
    specs: list[Any]
    buckets: list[_PlanBucket]
    #: The ``id()`` of each local tensor's owner, in bucket order (for overflow localisation).
    owner_ids: list[int]
    #: Positions of the plain replicated tensors the declarations describe, their
    #: (shape, dtype) and their listing, once a step with a norm made it.
    replica_positions: list[int] = field(default_factory=list)
    replica_meta: list[tuple[torch.Size, torch.dtype]] = field(default_factory=list)
    replica_listing: str | None = None
    #: How many warm steps reused it.
    uses: int = 0
    #: The device constants and scratch of its steps, one per thread that steps it (see
    #: [Note: whose scratch] in ``_arith``).
    scratches: dict[int, StepScratch] = field(default_factory=dict)

    def scratch(self) -> StepScratch:
        """This thread's :class:`StepScratch` for the plan's steps."""
        me = threading.get_ident()
        hit = self.scratches.get(me)
        if hit is None:
            hit = self.scratches[me] = StepScratch()
        return hit

    def remember_replicas(
        self, items: Sequence[torch.Tensor], positions: list[int], listing: str
    ) -> None:
        """Keep the declarations' listing of the plain replicated tensors at ``positions``."""
        self.replica_positions = positions
        self.replica_meta = _replica_meta(items, positions)
        self.replica_listing = listing

    def counted_index(self, key: _Key, device: torch.device) -> torch.Tensor:
        """The indices of the counted members of bucket ``key``, as a tensor on ``device``."""
        for bucket in self.buckets:
            if bucket.key == key:
                index = bucket.counted_index.get(device)
                if index is None:
                    picked = [i for i, c in enumerate(bucket.counts) if c]
                    index = torch.tensor(picked, dtype=torch.long, device=device)
                    bucket.counted_index[device] = index
                return index
        raise KeyError(key)


class StepPlans:
    """The step plans one owner keeps for the tensors it steps (see [Note: the step plan]).

    At most ``limit``, one per step key (group, ranks, declarations); a plan
    is looked up by key and then checked against the step's tensors, so an
    owner whose tensors change (a new parameter group) simply rebuilds, and
    the new plan lets go of the old tensors.
    """

    __slots__ = ("_limit", "_table")

    def __init__(self, *, limit: int = 4) -> None:
        if limit < 1:
            raise ValueError(f"StepPlans(limit={limit!r}): keep at least one plan")
        self._limit = limit
        self._table: dict[Hashable, StepPlan] = {}

    def __len__(self) -> int:
        return len(self._table)

    def __iter__(self) -> Iterator[StepPlan]:
        return iter(list(self._table.values()))

    def find(self, key: Hashable, catalog: object) -> StepPlan | None:
        """The plan kept under ``key`` for this registry ``catalog``, if any (not yet validated)."""
        plan = self._table.get(key)
        if plan is None or plan.catalog is not catalog:
            return None
        return plan

    def remember(self, plan: StepPlan) -> None:
        """Keep ``plan`` for the next step (replacing one under the same key)."""
        self._table.pop(plan.key, None)
        while len(self._table) >= self._limit:
            self._table.pop(next(iter(self._table)))  # the oldest
        self._table[plan.key] = plan

    def clear(self) -> None:
        """Drop every plan: the next step runs cold."""
        self._table.clear()


def build_plan(
    items: Sequence[torch.Tensor],
    buckets: GradBuckets,
    trace: Trace,
    *,
    key: Hashable,
    catalog: object,
    as_grads: bool,
) -> StepPlan | None:
    """A plan from a cold step's buckets and trace; None when this layout cannot be planned."""
    if not items or len(trace.locals) != buckets.count:
        return None
    if not trace.stable:
        return None  # an adapter that did not promise a stable answer: always cold
    present_positions = trace.positions
    if any(map(operator.ge, present_positions, itertools.islice(present_positions, 1, None))):
        return None  # the same tensor twice, or an order the trace does not keep
    locals_ = trace.locals
    grads: list[Any] = list(items) if as_grads else list(map(_GRAD, items))
    present = grads if len(present_positions) == len(grads) else _pick(grads, present_positions)
    dtensor_cls = dtensor_type()
    kinds = {
        kind: dtensor_cls is not None and issubclass(kind, dtensor_cls)
        for kind in set(map(type, present))
    }
    if len(kinds) == 1:  # one class of gradient (FSDP2: all DTensors): no per-tensor choice
        dtensor = [next(iter(kinds.values()))] * len(present)
    else:
        dtensor = list(map(kinds.__getitem__, map(type, present)))
    shards = list(itertools.compress(present, dtensor))
    plain = list(itertools.compress(present, map(operator.not_, dtensor)))
    # The plan takes locals directly: they must be what the adapters gave.
    if shards and not plain:
        expected: list[Any] = list(map(_LOCAL, shards))
    elif plain and not shards:
        expected = plain
    else:
        expected = [
            g._local_tensor if is_dt else g for g, is_dt in zip(present, dtensor, strict=True)
        ]
    if not all(map(operator.is_, locals_, expected)) or any(map(_SPARSE, plain)):
        return None
    specs = list(map(_SPEC, shards))
    members_of = trace.members
    if members_of is None:  # the walk's trace: find each bucket tensor's place
        slot = dict(zip(map(id, locals_), range(len(locals_)), strict=True))
        members_of = {
            bucket_key: [slot[id(t)] for t in tensors]
            for bucket_key, tensors in buckets.every.items()
        }
    params = list(items)
    plan_buckets: list[_PlanBucket] = []
    owner_params: list[torch.Tensor] = []
    all_items = len(buckets.every) == 1 and len(present_positions) == len(items)
    for bucket_key in buckets.every:
        members = members_of[bucket_key]
        owner_positions = _pick(present_positions, members)
        owners = None if all_items else owner_positions
        plan_buckets.append(
            _PlanBucket(bucket_key, members, owners, list(buckets.counts_mask[bucket_key]))
        )
        owner_params.extend(params if all_items else _pick(params, owner_positions))
    return StepPlan(
        key=key,
        catalog=catalog,
        grad_types=list(map(type, grads)),
        present=None if len(present_positions) == len(items) else present_positions,
        dtensor=dtensor,
        specs=specs,
        buckets=plan_buckets,
        owner_ids=list(map(id, owner_params)),
        params=params,
    )


def _pick(items: Sequence[Any], positions: Sequence[int]) -> list[Any]:
    return list(map(items.__getitem__, positions))


def _replica_meta(
    items: Sequence[torch.Tensor], positions: Sequence[int]
) -> list[tuple[torch.Size, torch.dtype]]:
    return [(items[i].shape, items[i].dtype) for i in positions]


def replicas_unchanged(plan: StepPlan, items: Sequence[torch.Tensor]) -> bool:
    """Whether the plain replicated tensors still have the shapes and dtypes the plan saw."""
    return _replica_meta(items, plan.replica_positions) == plan.replica_meta


def warm_buckets(
    plan: StepPlan, items: Sequence[torch.Tensor], *, as_grads: bool
) -> GradBuckets | None:
    """This step's buckets through ``plan``, or None when anything the plan rests on changed."""
    if len(items) != len(plan.params) or not all(map(operator.is_, plan.params, items)):
        return None  # other tensors, or the same ones in another order
    grads: Sequence[Any] = items if as_grads else list(map(_GRAD, items))
    if list(map(type, grads)) != plan.grad_types:
        return None  # a gradient appeared, went away, or changed class
    present = grads if plan.present is None else [grads[i] for i in plan.present]
    if len(plan.specs) == len(present):  # every gradient a DTensor (FSDP2): the common case
        if list(map(_SPEC, present)) != plan.specs:
            return None
        local: list[torch.Tensor] = list(map(_LOCAL, present))
    else:
        shards = [g for g, is_dt in zip(present, plan.dtensor, strict=True) if is_dt]
        plain = [g for g, is_dt in zip(present, plan.dtensor, strict=True) if not is_dt]
        if list(map(_SPEC, shards)) != plan.specs or any(map(_SPARSE, plain)):
            return None
        local = (
            list(present)
            if not shards
            else [
                g._local_tensor if is_dt else g
                for g, is_dt in zip(present, plan.dtensor, strict=True)
            ]
        )
    buckets = GradBuckets()
    if not local:
        return buckets if not plan.buckets else None
    # torch's own C++ grouping: the bucket keys and members, without a Python loop per tensor.
    grouped: dict[_Key, Any] = torch._C._group_tensors_by_device_and_dtype(
        [cast("list[torch.Tensor | None]", local)], True
    )
    if len(grouped) != len(plan.buckets):
        return None
    for bucket in plan.buckets:
        found = grouped.get(bucket.key)
        if found is None or list(found[1]) != bucket.members:
            return None
        tensors: list[torch.Tensor] = list(found[0][0])
        key = bucket.key
        buckets.every[key] = tensors
        buckets.owners[key] = (
            list(items) if bucket.owners is None else [items[i] for i in bucket.owners]
        )
        buckets.counts_mask[key] = bucket.counts
        if all(bucket.counts):
            buckets.counted[key] = tensors
        elif any(bucket.counts):
            buckets.counted[key] = [t for t, c in zip(tensors, bucket.counts, strict=True) if c]
    buckets.count = len(local)
    plan.uses += 1
    return buckets
