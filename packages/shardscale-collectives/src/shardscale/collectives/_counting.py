"""The ``counting`` middleware: a record of every collective that passes through it.

Place it where the collectives you want to count leave: ``counting+c10d``
counts what reaches the library; in ``coalescing+counting+c10d`` it sees the
coalesced collectives actually issued, in ``counting+coalescing+c10d`` the
requests before coalescing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from shardscale.collectives._c10d import check_reduce_args
from shardscale.core import CollectiveBackend, Handle, MiddlewareBase, ReduceOp

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["CollectiveRecord", "CountingMiddleware"]


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    """One collective issued through a :class:`CountingMiddleware`."""

    op: ReduceOp
    group_size: int
    nbytes: int
    dtype: torch.dtype
    numel: int
    device: str


class CountingMiddleware(MiddlewareBase):
    """Records op, group size, bytes, dtype and numel of every ``all_reduce`` it forwards.

    Only collectives the inner chain accepted are recorded (a call that raises
    leaves no record). Read :attr:`records`; clear them with :meth:`reset`.
    """

    name: ClassVar[str] = "counting"

    def __init__(self, inner: CollectiveBackend) -> None:
        super().__init__(inner)
        self.records: list[CollectiveRecord] = []

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp, group: ProcessGroup | None
    ) -> Handle:
        """Forward to the inner backend, then record the collective."""
        reduce_op = check_reduce_args(tensor, op)
        handle = self.inner.all_reduce(tensor, op=reduce_op, group=group)
        self.records.append(
            CollectiveRecord(
                op=reduce_op,
                group_size=self.inner.world_size(group),
                nbytes=tensor.numel() * tensor.element_size(),
                dtype=tensor.dtype,
                numel=tensor.numel(),
                device=tensor.device.type,
            )
        )
        return handle

    def reset(self) -> None:
        """Forget every record."""
        self.records.clear()

    @property
    def total_bytes(self) -> int:
        """Bytes this rank contributed to the recorded collectives."""
        return sum(r.nbytes for r in self.records)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r}, records={len(self.records)})"
