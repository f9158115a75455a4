"""The ``c10d`` backend: reductions through ``torch.distributed`` on whatever group it is given.

[Note: any torch.distributed backend]
``c10d`` never looks at which library moves the bytes: it calls
``torch.distributed.all_reduce`` on the group it receives, so gloo, nccl, mpi,
ucc and backends registered with ``torch.distributed.Backend.register_backend``
(a custom CUDA collective, a Python ``ProcessGroup`` subclass) all work. The
call is asynchronous (``async_op=True``); the returned handle wraps the c10d
``Work`` so the caller decides when to wait, and on CUDA ``wait()`` only makes
the current stream wait, without a host synchronisation.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from shardscale.core import BackendUnavailableError, ReduceOp, ShardscaleError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Work

__all__ = [
    "C10dBackend",
    "CollectiveError",
    "WorkHandle",
    "check_reduce_args",
    "require_initialized",
]


class CollectiveError(ShardscaleError):
    """A collective failed or timed out, typically because a peer rank died or never joined.

    The message names the collective, the group's ranks, library and timeout; the
    original ``torch.distributed`` error is chained as ``__cause__``.
    """


def _group_timeout(group: ProcessGroup | None, device: torch.device) -> float | None:
    import torch.distributed as dist

    try:
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None
        return float(pg._get_backend(device).options._timeout.total_seconds())
    except Exception:  # best effort: not every backend exposes its options
        return None


def _describe(tensor: torch.Tensor, op: ReduceOp, group: ProcessGroup | None) -> Callable[[], str]:
    # Only the cheap facts are captured per call; the text is built when something failed.
    dtype, numel, device = tensor.dtype, tensor.numel(), tensor.device

    def describe() -> str:
        import torch.distributed as dist

        try:
            ranks: object = dist.get_process_group_ranks(
                group if group is not None else dist.group.WORLD  # type: ignore[arg-type]
            )
            library: object = dist.get_backend(group)
        except Exception:
            ranks, library = "?", "?"
        timeout = _group_timeout(group, device)
        limit = "unknown timeout" if timeout is None else f"timeout {timeout:g}s"
        return (
            f"all_reduce({op.value}) of {numel} {str(dtype).removeprefix('torch.')} element(s) "
            f"over the process group of ranks {ranks} ({library}, {limit})"
        )

    return describe


def _translate(describe: Callable[[], str], exc: BaseException) -> CollectiveError:
    import torch.distributed as dist

    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CollectiveError(
        f"{describe()} failed on global rank {dist.get_rank()}: {detail}. A rank of this group "
        "probably died, raised, or did not reach the same collective within the timeout: "
        "every rank must issue the same collectives in the same order (e.g. call "
        "scaler.step()/unscale_() for the same optimizers on every rank). Look for the first "
        "rank that failed; its error is the cause."
    )


class WorkHandle:
    """A pending c10d reduction: ``wait()`` waits on the wrapped ``torch.distributed.Work``.

    A failure (a peer that died or never joined, a timeout) is raised as
    :class:`CollectiveError` naming the collective and the group's timeout.
    """

    __slots__ = ("_describe", "_work")

    def __init__(self, work: Work, describe: Callable[[], str] | None = None) -> None:
        self._work: Work | None = work
        self._describe = describe

    def wait(self) -> None:
        """Wait for the collective (idempotent: later calls return at once)."""
        if self._work is not None:
            work, self._work = self._work, None
            try:
                work.wait()
            except RuntimeError as exc:
                if self._describe is None:
                    raise
                raise _translate(self._describe, exc) from exc


def check_reduce_args(tensor: object, op: object) -> ReduceOp:
    """Validate an ``all_reduce`` request before anything is issued; return the op as ReduceOp."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"all_reduce() takes a torch.Tensor, got {type(tensor).__name__}; wrap Python "
            "numbers with torch.tensor(...)"
        )
    if tensor.is_sparse:
        raise TypeError(
            "all_reduce() takes a dense tensor; reduce a sparse tensor's values "
            "(tensor.coalesce().values()) instead"
        )
    try:
        return ReduceOp(op if isinstance(op, str) else str(op))
    except ValueError:
        raise ValueError(
            f"unknown reduction {op!r}; shardscale reduces with {[o.value for o in ReduceOp]} "
            "(shardscale.core.ReduceOp.SUM or .MAX)"
        ) from None


def _torch_op(op: ReduceOp) -> torch.distributed.ReduceOp.RedOpType:
    import torch.distributed as dist

    return dist.ReduceOp.SUM if op is ReduceOp.SUM else dist.ReduceOp.MAX


def require_initialized(backend_name: str) -> None:
    """Raise a clear error unless a default process group exists."""
    import torch.distributed as dist

    if not dist.is_available():
        raise BackendUnavailableError(
            f"the {backend_name!r} backend needs torch.distributed, which this torch build "
            "lacks; use the 'local' backend for a single process"
        )
    if not dist.is_initialized():
        raise BackendUnavailableError(
            f"the {backend_name!r} backend needs an initialized process group: call "
            "torch.distributed.init_process_group(...) first (torchrun sets up the "
            "environment), or use the 'local' backend for a single process"
        )


#: id(group) -> (weak reference to the group, its global ranks); a few entries.
_GROUP_RANKS: collections.OrderedDict[int, tuple[weakref.ref[Any], tuple[int, ...]]] = (
    collections.OrderedDict()
)


class C10dBackend:
    """Reduces over any ``torch.distributed`` process group, whatever its backend.

    ``group=None`` means the default group. The caller's rank must belong to
    the group.
    """

    name: ClassVar[str] = "c10d"
    #: Chosen when no backend is named and a process group is initialized (the registry
    #: picks the usable backend with the highest value; core names no backend of ours).
    automatic_priority: ClassVar[int | None] = 0

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp, group: ProcessGroup | None
    ) -> WorkHandle:
        """Start ``all_reduce(tensor, op)`` on ``group`` asynchronously; wait on the handle."""
        import torch.distributed as dist

        reduce_op = check_reduce_args(tensor, op)
        self._check_group(group)
        describe = _describe(tensor, reduce_op, group)
        try:
            work = dist.all_reduce(tensor, op=_torch_op(reduce_op), group=group, async_op=True)
        except RuntimeError as exc:  # a peer already known dead fails at once
            raise _translate(describe, exc) from exc
        if work is None:  # only when this rank is outside the group, which _check_group refuses
            raise BackendUnavailableError("torch.distributed.all_reduce issued no work")
        return WorkHandle(work, describe)

    def world_size(self, group: ProcessGroup | None) -> int:
        """Number of ranks in ``group`` (the default group when ``None``)."""
        import torch.distributed as dist

        self._check_group(group)
        return int(dist.get_world_size(group))

    def rank(self, group: ProcessGroup | None) -> int:
        """This process's rank inside ``group``."""
        import torch.distributed as dist

        self._check_group(group)
        return int(dist.get_rank(group))

    def group_ranks(self, group: ProcessGroup | None) -> tuple[int, ...]:
        """Global ranks of ``group`` in group order."""
        import torch.distributed as dist

        self._check_group(group)
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None
        # A group's ranks never change: the same tuple every step, not O(W) work each time.
        hit = _GROUP_RANKS.get(id(pg))
        if hit is not None and hit[0]() is pg:
            return hit[1]
        ranks = tuple(int(r) for r in dist.get_process_group_ranks(pg))
        # A weak reference: a destroyed group is freed as before (its id may then be reused,
        # which the identity test above sees).
        _GROUP_RANKS[id(pg)] = (weakref.ref(pg), ranks)
        if len(_GROUP_RANKS) > 16:
            _GROUP_RANKS.popitem(last=False)
        return ranks

    def _check_group(self, group: ProcessGroup | None) -> None:
        import torch.distributed as dist

        require_initialized(self.name)
        if group is not None and dist.get_rank(group) < 0:
            raise BackendUnavailableError(
                f"this process (global rank {dist.get_rank()}) is not a member of the process "
                f"group it was asked to reduce over (ranks "
                f"{dist.get_process_group_ranks(group)}); pass a group this rank belongs to"
            )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run here, or ``None``."""
        import torch.distributed as dist

        if not dist.is_available():
            return "torch.distributed is not available in this torch build"
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
