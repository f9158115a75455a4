"""The contracts that plugins implement.

[Note: one step as data]
An optimizer step is described by data flowing through four kinds of plugin:

* a *grad adapter* turns each parameter's gradient into a :class:`GradShard`:
  the local tensor to read and write, and whether this rank's copy *counts*
  towards global sums (only one replica of each logical shard does, so sums
  stay exact and are never double-counted);
* a *stats kernel* reads lists of local tensors once and produces per-tensor
  norms (non-finite when the tensor is), or unscales them in place while
  checking for non-finite values;
* a *collective backend* (possibly wrapped in middleware) combines every rank's
  partials in ONE all-reduce over the reduction group;
* *step observers* receive a :class:`StepRecord` after each ``update()``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "ReduceOp",
    "Handle",
    "CompletedHandle",
    "CollectiveBackend",
    "Middleware",
    "GradShard",
    "AdapterContext",
    "GradAdapter",
    "StatsKernels",
    "LayoutAwareAdapter",
    "OverflowSafeKernels",
    "promises_stable_layout",
    "layout_keys_of",
    "claims_type_of",
    "overflow_safe",
    "StepRecord",
]


class ReduceOp(enum.StrEnum):
    """The reductions a backend offers: the step engine uses SUM; MAX is there for plugins."""

    SUM = "sum"
    MAX = "max"


@runtime_checkable
class Handle(Protocol):
    """A pending reduction. After :meth:`wait` returns, the tensor holds the result."""

    def wait(self) -> None:
        """Block (or enqueue device work) until the reduced value is in the tensor."""


class CompletedHandle:
    """A handle for a reduction that already finished."""

    __slots__ = ()

    def wait(self) -> None:
        """Nothing to wait for."""


@runtime_checkable
class CollectiveBackend(Protocol):
    """Reduces small tensors across the ranks of a process group.

    Implementations are created by the registry from a class exposing ``name``;
    middleware wrap another backend and keep this same interface.
    """

    name: ClassVar[str]

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp, group: ProcessGroup | None
    ) -> Handle:
        """Reduce ``tensor`` in place over ``group`` (``None``: the default group).

        The result is only guaranteed to be in ``tensor`` after the returned
        handle's ``wait()``.
        """
        ...

    def world_size(self, group: ProcessGroup | None) -> int:
        """Number of ranks in ``group``."""
        ...

    def rank(self, group: ProcessGroup | None) -> int:
        """This process's rank inside ``group``."""
        ...

    def group_ranks(self, group: ProcessGroup | None) -> tuple[int, ...]:
        """Global ranks of ``group``, in group order."""
        ...


@runtime_checkable
class Middleware(Protocol):
    """A wrapper around a backend, chosen by name (``counting+coalescing+c10d``)."""

    name: ClassVar[str]
    inner: CollectiveBackend


@dataclass(frozen=True, slots=True)
class GradShard:
    """What an adapter says about one parameter's gradient on this rank.

    ``local`` is the plain tensor holding this rank's part of the gradient (it
    is read for statistics and scaled in place). ``counts`` is False on ranks
    holding a replica that another rank already contributes, so a SUM over
    every rank counts each element exactly once. ``ranks`` is the set of global
    ranks that hold some part of this gradient (``None`` when that is every
    rank of the reduction group); the reduction group must contain them all.
    """

    local: torch.Tensor
    counts: bool = True
    ranks: frozenset[int] | None = None


@dataclass(frozen=True, slots=True)
class AdapterContext:
    """Run-time facts adapters need when describing a gradient.

    ``group`` is the reduction group of the caller (the scaler's or the clip
    call's process group; ``None`` for the default group or no distributed).
    ``distinct_dims`` names mesh dimensions whose coordinates hold *different*
    parameters (pipeline stages): adapters never treat them as replicas.
    ``distinct_params`` holds the ``id()`` of plain-tensor parameters that
    this rank holds its own of (experts placed on this rank): they count on
    every rank that has them.
    """

    group: ProcessGroup | None = None
    distinct_dims: frozenset[str] = frozenset()
    distinct_params: frozenset[int] = frozenset()
    rank: int = 0
    world_size: int = 1


@runtime_checkable
class GradAdapter(Protocol):
    """Recognises a family of parameters and describes their gradients."""

    name: ClassVar[str]
    #: Higher wins when several adapters claim the same parameter.
    priority: ClassVar[int]

    def claims(self, param: torch.Tensor) -> bool:
        """Whether this adapter knows how to describe ``param``'s gradient."""
        ...

    def describe(self, param: torch.Tensor, grad: torch.Tensor, ctx: AdapterContext) -> GradShard:
        """Return the local data and the replica status of ``grad`` on this rank."""
        ...


@runtime_checkable
class StatsKernels(Protocol):
    """Reads and scales lists of same-device, same-dtype gradient tensors."""

    name: ClassVar[str]
    #: Higher wins among kernels that support a device.
    priority: ClassVar[int]

    def supports(self, device: torch.device) -> bool:
        """Whether the kernels can run on ``device`` here."""
        ...

    def unscale_and_check_(
        self, tensors: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
    ) -> None:
        """Multiply in place by ``inv_scale``; set ``found_inf`` to 1 on any inf/nan."""
        ...

    def tensor_norms(self, tensors: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        """Each tensor's p-norm (max|x| for ``inf``) in ONE read: a 1-D tensor, one per input.

        float32 accumulation (float64 for float64 tensors); 0 for an empty
        tensor. A non-finite element must make that tensor's entry non-finite
        (nan for nan), which is how the overflow check rides on the same read.
        The step engine keeps powers from overflowing (it normalises for
        p other than 1, 2 and inf, and for float64 p = 2: a max read, a
        division and a second read), so kernels compute plainly. Kernels that
        already keep every power from overflowing in their one read may set
        the optional class attribute ``overflow_safe_norms = True`` (read with
        ``getattr``; absent means False): the engine then calls this once for
        every p and dtype.
        """
        ...

    def mul_(self, tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
        """Multiply every tensor in place by the 0-dim tensor ``coef``."""
        ...


@runtime_checkable
class LayoutAwareAdapter(GradAdapter, Protocol):
    """The optional members of a :class:`GradAdapter` that let a step describe a layout once.

    ``stable_layout = True`` promises that :meth:`~GradAdapter.describe`'s answer
    rests only on the gradient's class, placement and what :meth:`layout_keys`
    returns, so a step plan may reuse it and parameters with equal keys share one
    description. ``claims_type(kind)`` answers ``claims`` for a whole class:
    True (claims every instance), False (none), None (the parameter decides).
    Each member is optional: the engine reads them through
    :func:`promises_stable_layout`, :func:`layout_keys_of` and :func:`claims_type_of`,
    which give the plain per-parameter behaviour where one is absent.
    """

    stable_layout: ClassVar[bool]

    def claims_type(self, kind: type) -> bool | None:
        """Whether every (True), no (False) or some (None) parameter of class ``kind`` is claimed."""
        ...

    def layout_keys(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], ctx: AdapterContext
    ) -> Sequence[Hashable] | None:
        """Per parameter, a key: equal keys get the same description (None: ask each one)."""
        ...


@runtime_checkable
class OverflowSafeKernels(StatsKernels, Protocol):
    """The optional member of :class:`StatsKernels`: ``overflow_safe_norms = True`` says that
    :meth:`~StatsKernels.tensor_norms` keeps every power from overflowing in its one read, so
    the engine calls it once for every p and dtype (read by :func:`overflow_safe`)."""

    overflow_safe_norms: ClassVar[bool]


def promises_stable_layout(adapter: object) -> bool:
    """``adapter``'s ``stable_layout`` promise (absent: False)."""
    return getattr(type(adapter), "stable_layout", False) is True


def layout_keys_of(
    adapter: object,
) -> Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], AdapterContext], Any] | None:
    """``adapter.layout_keys`` where it promises a stable layout and has one, else None."""
    if not promises_stable_layout(adapter):
        return None
    keys: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], AdapterContext], Any] | None
    keys = getattr(adapter, "layout_keys", None)
    return keys


def claims_type_of(adapter: object) -> Callable[[type], bool | None] | None:
    """``adapter.claims_type`` where it has one, else None."""
    probe: Callable[[type], bool | None] | None = getattr(adapter, "claims_type", None)
    return probe


def overflow_safe(kernels: object) -> bool:
    """Whether ``kernels`` set ``overflow_safe_norms = True`` (absent: False)."""
    return getattr(kernels, "overflow_safe_norms", False) is True


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What happened in one scaler iteration, handed to ``shardscale_on_step``.

    Values are tensors on the scaler's device so that recording costs no
    host-device synchronisation: an observer that needs Python numbers should
    keep the records and read many at once (``shardscale.telemetry`` does).
    ``scale``, ``growth_tracker`` and ``hysteresis_tracker`` are the values
    *after* this update (``scale`` is what ``get_scale()`` returns now).
    ``grad_norm`` is set when ``unscale_and_clip_`` ran. ``nonfinite_per_rank``
    (1-D, one entry per rank of the scaler's process group) counts the local
    gradients that held inf/nan on each rank, read from the step's all-reduce
    (see ``StepResult.nonfinite_ranks``); ``None`` when no step engine ran.
    ``skipped`` is the step's verdict, for any reason; ``found_inf`` only a
    non-finite gradient (what backs the scale off); ``skip_reason`` says why.
    """

    step: int
    scale: torch.Tensor
    found_inf: torch.Tensor
    skipped: torch.Tensor
    growth_tracker: torch.Tensor
    grad_norm: torch.Tensor | None = None
    hysteresis_tracker: torch.Tensor | None = None
    nonfinite_per_rank: torch.Tensor | None = None
    #: Why the step was skipped: a 0-dim int64 tensor holding a ``SkipReason`` value
    #: (0, ``NONE``: taken); ``None`` from code that does not set it.
    skip_reason: torch.Tensor | None = None
