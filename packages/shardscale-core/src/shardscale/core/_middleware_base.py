"""A base class for middleware: everything forwards to the wrapped backend unless overridden."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from shardscale.core._protocols import CollectiveBackend, Handle, ReduceOp

__all__ = ["MiddlewareBase"]


class MiddlewareBase:
    """Wraps ``inner`` and forwards every call to it; subclasses override what they change.

    Subclasses set ``name`` and usually override :meth:`all_reduce`.
    """

    name: ClassVar[str] = ""

    def __init__(self, inner: CollectiveBackend) -> None:
        self.inner = inner

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp, group: ProcessGroup | None
    ) -> Handle:
        """As the inner backend."""
        return self.inner.all_reduce(tensor, op=op, group=group)

    def world_size(self, group: ProcessGroup | None) -> int:
        """As the inner backend."""
        return self.inner.world_size(group)

    def rank(self, group: ProcessGroup | None) -> int:
        """As the inner backend."""
        return self.inner.rank(group)

    def group_ranks(self, group: ProcessGroup | None) -> tuple[int, ...]:
        """As the inner backend."""
        return self.inner.group_ranks(group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
