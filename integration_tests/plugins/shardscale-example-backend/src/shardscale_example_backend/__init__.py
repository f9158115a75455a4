"""A minimal third-party shardscale plugin: the ``example`` collective backend.

Everything a plugin author needs is here: a class with a ``name``, the four
methods of :class:`shardscale.core.CollectiveBackend`, an optional
``unavailable_reason`` classmethod, and a ``@hookimpl`` function returning the
class, exposed through ``[project.entry-points.shardscale]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from shardscale.core import Handle, ReduceOp, hookimpl
from shardscale.core.plugins import CompletedHandle

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = ["ExampleBackend", "shardscale_collective_backends"]


class _WorkHandle:
    __slots__ = ("_work",)

    def __init__(self, work: object) -> None:
        self._work = work

    def wait(self) -> None:
        self._work.wait()  # type: ignore[attr-defined]


def _distributed() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


class ExampleBackend:
    """torch.distributed when a process group exists, the identity otherwise; counts calls."""

    name: ClassVar[str] = "example"
    #: How many reductions any ExampleBackend issued in this process (tests read it).
    calls: ClassVar[int] = 0

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp, group: ProcessGroup | None
    ) -> Handle:
        """Reduce ``tensor`` in place over ``group``."""
        type(self).calls += 1
        if not _distributed():
            return CompletedHandle()
        import torch.distributed as dist

        torch_op = dist.ReduceOp.SUM if ReduceOp(op) is ReduceOp.SUM else dist.ReduceOp.MAX
        return _WorkHandle(dist.all_reduce(tensor, op=torch_op, group=group, async_op=True))

    def world_size(self, group: ProcessGroup | None) -> int:
        """Ranks in ``group`` (1 without torch.distributed)."""
        import torch.distributed as dist

        return int(dist.get_world_size(group)) if _distributed() else 1

    def rank(self, group: ProcessGroup | None) -> int:
        """This rank in ``group`` (0 without torch.distributed)."""
        import torch.distributed as dist

        return int(dist.get_rank(group)) if _distributed() else 0

    def group_ranks(self, group: ProcessGroup | None) -> tuple[int, ...]:
        """Global ranks of ``group``."""
        import torch.distributed as dist

        if not _distributed():
            return (0,)
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None
        return tuple(dist.get_process_group_ranks(pg))

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Runs everywhere."""
        return None


@hookimpl
def shardscale_collective_backends() -> Sequence[type]:
    """The ``example`` backend."""
    return [ExampleBackend]
