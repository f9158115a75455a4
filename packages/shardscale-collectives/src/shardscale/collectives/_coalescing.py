"""The ``coalescing`` middleware: many small reductions leave as one collective per group and op.

[Note: deferred issue, deterministic order]
``all_reduce`` only queues the request and returns a handle. The first
``wait()`` on any pending handle (or an explicit :meth:`flush`) issues the whole
queue: requests sharing (group, op, device, dtype) are copied into one flat
buffer, reduced in ONE inner collective, and copied back on ``wait()``. Batches
leave in program order (ordered by each batch's first request), so every rank
that made the same requests in the same order issues the same collectives in
the same order: ranks never mismatch. As with any asynchronous collective, a
queued tensor must not be modified before its handle's ``wait()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from shardscale.collectives._c10d import check_reduce_args
from shardscale.core import CollectiveBackend, Handle, MiddlewareBase, ReduceOp

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["CoalescingMiddleware"]

_Key = tuple[Any, ReduceOp, torch.device, torch.dtype]


class _Batch:
    """Requests leaving as one collective; finished (copied back) at most once."""

    __slots__ = ("error", "error_is_own", "flat", "handle", "tensors")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.flat: torch.Tensor | None = None
        self.handle: Handle | None = None
        self.error: BaseException | None = None
        self.error_is_own = False

    def issue(self, inner: CollectiveBackend, op: ReduceOp, group: ProcessGroup | None) -> None:
        only = self.tensors[0]
        if len(self.tensors) == 1 and only.is_contiguous():
            self.handle = inner.all_reduce(only, op=op, group=group)
            return
        with torch.no_grad():
            self.flat = torch.cat([t.detach().reshape(-1) for t in self.tensors])
        self.handle = inner.all_reduce(self.flat, op=op, group=group)

    def finish(self) -> None:
        if self.error is not None:
            why = (
                "failed"
                if self.error_is_own
                else "was never issued: an earlier one in its flush failed"
            )
            raise RuntimeError(
                f"this coalesced reduction {why} (see the chained error)"
            ) from self.error
        if self.handle is None:
            return  # already finished
        handle, self.handle = self.handle, None
        handle.wait()
        if self.flat is not None:
            offset = 0
            with torch.no_grad():
                for tensor in self.tensors:
                    n = tensor.numel()
                    tensor.copy_(self.flat[offset : offset + n].view(tensor.shape))
                    offset += n
        self.flat = None
        self.tensors = []


class _PendingHandle:
    """Handle of a queued request: its first ``wait()`` flushes the queue if still needed."""

    __slots__ = ("_batch", "_owner")

    def __init__(self, owner: CoalescingMiddleware) -> None:
        self._owner = owner
        self._batch: _Batch | None = None

    def wait(self) -> None:
        """Flush the queue if this request is still in it, then wait for its batch."""
        if self._batch is None:
            self._owner.flush()
        assert self._batch is not None
        self._batch.finish()


class CoalescingMiddleware(MiddlewareBase):
    """Queues reductions and issues one collective per (group, op, device, dtype) on flush."""

    name: ClassVar[str] = "coalescing"

    def __init__(self, inner: CollectiveBackend) -> None:
        super().__init__(inner)
        self._queue: list[tuple[torch.Tensor, ReduceOp, ProcessGroup | None, _PendingHandle]] = []

    @property
    def pending(self) -> int:
        """Number of requests queued and not yet issued."""
        return len(self._queue)

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp, group: ProcessGroup | None
    ) -> Handle:
        """Queue the reduction; it is issued at the first ``wait()`` or :meth:`flush`."""
        reduce_op = check_reduce_args(tensor, op)
        handle = _PendingHandle(self)
        self._queue.append((tensor, reduce_op, group, handle))
        return handle

    def flush(self) -> None:
        """Issue every queued request now, one inner collective per batch, in program order."""
        queue, self._queue = self._queue, []
        # dicts keep insertion order: batches leave ordered by their first request.
        batches: dict[_Key, tuple[ProcessGroup | None, ReduceOp, _Batch]] = {}
        for tensor, op, group, handle in queue:
            key = (group, op, tensor.device, tensor.dtype)
            if key not in batches:
                batches[key] = (group, op, _Batch([]))
            batch = batches[key][2]
            batch.tensors.append(tensor)
            handle._batch = batch
        failure: BaseException | None = None
        for group, op, batch in batches.values():
            if failure is not None:
                batch.error = failure
                continue
            try:
                batch.issue(self.inner, op, group)
            except BaseException as exc:
                batch.error, batch.error_is_own = exc, True
                failure = exc
        if failure is not None:
            raise failure

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r}, pending={len(self._queue)})"
