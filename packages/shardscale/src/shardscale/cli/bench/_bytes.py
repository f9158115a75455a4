"""Bytes of gradient memory that aten ops actually read and write, counted while they run.

[Note: counting gradient bytes]
:class:`GradBytesCounter` is a ``TorchDispatchMode``. It is given the
gradients (their local tensors) and sees every aten op run under it:

* DTensor ops are handed on (the mode returns ``NotImplemented``), so it sees
  the ops DTensor runs on the local shards, i.e. what the kernels touch;
* read: every tensor argument that overlaps gradient memory, by the bytes of
  the overlap, except views (no data moves) and arguments that an op only
  overwrites (``copy_``, ``fill_``, ``zero_``, ``out=``);
* written: every argument the op's schema marks as mutated (``Tensor(a!)``)
  that overlaps gradient memory *and whose bits changed*. The schema alone
  over-counts: ``_fused_adam_`` declares its gradients mutable but writes them
  only when given ``grad_scale``. Comparing bits misses a write of identical
  values, so the benchmark counts in a step whose clipping coefficient is
  below 1 and whose loss scale is not 1: every real write then changes bits
  (an all-zero gradient would still hide one; the benchmark model has none).

The other memory a step touches in gradient-sized passes -- parameters and
optimizer state (:meth:`GradBytesCounter.add_state`) -- is counted beside
it (``state_read``/``state_written``), its writes by the schema alone: an
optimizer writes what it declares mutated, and a tiny update may leave a
parameter's bits unchanged without having cost less.

Nothing here is a formula: the counts are whatever the ops did.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = ["GradBytesCounter", "local_tensor", "span"]

_OVERWRITE_ONLY = frozenset({"aten::copy_", "aten::fill_", "aten::zero_", "aten::_foreach_copy_"})
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, or ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the bytes ``t`` can touch (its whole extent for a strided view)."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (t.data_ptr(), t.data_ptr() + (extent + 1) * t.element_size())


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge sorted, possibly overlapping [start, end) spans."""
    out: list[tuple[int, int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _overlap(ranges: list[tuple[int, int]], tensors: Iterable[torch.Tensor]) -> int:
    spans = sorted(span(t) for t in tensors if t.device.type != "meta" and t.numel() > 0)
    total = 0
    for lo, hi in _union(spans):
        for glo, ghi in ranges:
            total += max(0, min(hi, ghi) - max(lo, glo))
    return total


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(_INT_OF_SIZE[t.element_size()]).clone()


class GradBytesCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts bytes of gradient memory read and written by the aten ops run under it.

    ``with GradBytesCounter(grads) as c: post()`` then read :attr:`read`,
    :attr:`written` and :attr:`by_op` (op name -> [read, written]);
    :attr:`state_read` and :attr:`state_written` for the tensors given to
    :meth:`add_state` (parameters, optimizer state). With
    ``active=False`` nothing is counted until :attr:`active` is set (used to
    count only inside backward hooks); :meth:`add` adds gradients later.
    """

    def __init__(self, grads: Iterable[torch.Tensor] = (), *, active: bool = True) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._ranges: list[tuple[int, int]] = []
        self.read = 0
        self.written = 0
        self.by_op: Counter[str] = Counter()
        self.by_op_written: Counter[str] = Counter()
        self.active = active
        self._state: list[tuple[int, int]] = []
        self.state_read = 0
        self.state_written = 0
        self.add(grads)

    def add(self, grads: Iterable[torch.Tensor]) -> None:
        """Treat the memory of ``grads`` (local shards of DTensors) as gradient memory."""
        spans = [span(local_tensor(g)) for g in grads]
        self._ranges = _union(sorted(self._ranges + [s for s in spans if s[1] > s[0]]))

    def add_state(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the memory of ``tensors`` (parameters, optimizer state) as state, not gradients."""
        spans = [span(local_tensor(t)) for t in tensors]
        self._state = _union(sorted(self._state + [s for s in spans if s[1] > s[0]]))

    def overlap(self, *tensors: torch.Tensor) -> int:
        """Bytes of gradient memory inside the union of the tensors' extents (each byte once)."""
        return _overlap(self._ranges, tensors)

    def state_overlap(self, *tensors: torch.Tensor) -> int:
        """Bytes of state memory (:meth:`add_state`) inside the union of the tensors' extents."""
        return _overlap(self._state, tensors)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        leaves = [*args, *kwargs.values()]
        flat = [t for v in leaves for t in _tensors(v)]
        if any(is_traceable_wrapper_subclass(t) for t in flat):
            return NotImplemented  # let DTensor run; its ops on the local shards come back here
        if not self.active or not (self._ranges or self._state):
            return func(*args, **kwargs)
        schema = func._schema
        is_view = any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        )
        name = schema.name
        reads: list[torch.Tensor] = []
        mutated: list[torch.Tensor] = []
        state_reads: list[torch.Tensor] = []
        state_writes: list[torch.Tensor] = []
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            write = arg.alias_info is not None and arg.alias_info.is_write
            overwrite_only = write and (arg.name == "out" or name in _OVERWRITE_ONLY)
            for t in _tensors(value):
                if self._state and self.state_overlap(t):
                    if write:
                        state_writes.append(t)
                    if not is_view and not overwrite_only:
                        state_reads.append(t)
                if not self.overlap(t):
                    continue
                if write:
                    mutated.append(t)
                if not is_view and not overwrite_only:
                    reads.append(t)
        self.state_read += self.state_overlap(*state_reads)
        self.state_written += self.state_overlap(*state_writes)
        # A tensor passed twice (dot(g, g)) is one read of its memory: count the union.
        read = self.overlap(*reads)
        before = [_bits(t) for t in mutated]
        out = func(*args, **kwargs)
        changed = [
            t for t, old in zip(mutated, before, strict=True) if not torch.equal(_bits(t), old)
        ]
        written = self.overlap(*changed)
        self.read += read
        self.written += written
        if read:
            self.by_op[name] += read
        if written:
            self.by_op_written[name] += written
        return out
