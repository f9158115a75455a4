"""The buckets a step reads: local gradient tensors grouped by (device, dtype), and their owners.

Shared by the scaler and the clipping package: one walk over the parameters,
each described by the adapter that claims it, grouped by (device, dtype) so the
stats kernels run once per group.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shardscale.core._errors import LayoutError

if TYPE_CHECKING:
    pass

__all__ = [
    "GradBuckets",
    "GradOwners",
    "Trace",
    "check_ranks",
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


class GradOwners(Collection[tuple[int, "torch.Tensor | None"]]):
    """Whose gradient each local tensor a step read was, in bucket order, as two columns.

    The scaler keeps them for overflow localisation: ``ids`` are the owning
    parameters' ``id()`` s (names come from the module or the optimizer that
    holds them), ``tensors`` the local gradients, looked at again by a skipped
    ``step()`` whose kernel gave only one flag. No weak references: torch's
    ``swap_tensors`` (``module.to()`` on DTensor parameters, or on any
    parameter under ``torch.__future__.set_swap_module_params_on_conversion``)
    refuses a tensor that has one. No parameter either: a kept iteration must
    not keep a model alive. The gradients are let go with :meth:`release`
    once the iteration is over, so a kept iteration holds no gradient memory.
    Two lists instead of one tuple per tensor: with 10^4 parameters, 10^4
    tuples per step kept past the step set off full garbage collections.
    """

    __slots__ = ("ids", "tensors")

    def __init__(self, ids: list[int], tensors: list[torch.Tensor]) -> None:
        if len(ids) != len(tensors):
            raise ValueError(f"{len(ids)} parameters for {len(tensors)} tensors")
        self.ids = ids
        self.tensors: list[torch.Tensor] | None = tensors

    def release(self) -> None:
        """Let go of the local tensors (the ids stay, for the names)."""
        self.tensors = None

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor | None]]:
        if self.tensors is None:
            return zip(self.ids, itertools.repeat(None))
        return zip(self.ids, self.tensors, strict=True)

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
