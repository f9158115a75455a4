"""The step vector's device arithmetic in few ops: this rank's slots in, the decision's inputs out.

[Note: the step's fixed cost]
Every device op of a step is a kernel launch on a GPU (~5 us of host time
each) and a dispatch on the CPU, whatever the model's size, so the vector's
bookkeeping is written to a budget (``test_step_op_budget``): this rank's
values are computed as 0-dim tensors, stacked once and put into the zero
vector with one ``index_put_`` at indices cached per layout; the reduced
vector is read as a (blocks x W) view with one ``aminmax`` and one
comparison, which give every flag of the decision at once (:class:`Summary`).
Constants (the packed status, the indices, the flags' thresholds) live on
the device, cached, so a warm step copies nothing from the host.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from shardscale.core._step_vector import STATUS_ERROR_UNIT, VectorLayout

__all__ = ["TINY64", "Summary", "fill_local", "summarize"]

#: The smallest positive float64: clamping a non-negative peak to it changes only a zero peak
#: (whose tensors are all zero, so dividing them by it still gives 0).
TINY64 = math.ulp(0.0)

_F64 = torch.float64


@functools.lru_cache(maxsize=64)
def _constant(value: float, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=_F64).to(device)


@functools.lru_cache(maxsize=64)
def _index(slots: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64).to(device)


def fill_local(
    layout: VectorLayout,
    rank: int,
    device: torch.device,
    *,
    slots: dict[str, torch.Tensor],
    shared: dict[str, torch.Tensor],
    status: float,
) -> torch.Tensor:
    """The zero vector with this rank's ``slots``, its ``status`` and its ``shared`` values set.

    Values are 0-dim tensors on ``device`` (any real or bool dtype: the stack
    promotes them to float64); slots left out stay 0. Three ops.
    """
    index = [layout.slot(name, rank) for name in slots] + [layout.slot("status", rank)]
    index += [layout.shared(name) for name in shared]
    values = torch.stack([*slots.values(), _constant(status, device), *shared.values()])
    vec = torch.zeros(layout.size, dtype=_F64, device=device)
    return vec.index_put_((_index(tuple(index), device),), values)


@functools.lru_cache(maxsize=16)
def _caps(blocks: tuple[str, ...], device: torch.device) -> torch.Tensor:
    # A block's flag is max > min(min, cap): for counts (cap 0, values >= 0) "any rank > 0";
    # for status (cap 2**48 - 1) "any rank holds an error code, or two ranks differ".
    caps = {"nonfinite": 0.0, "status": STATUS_ERROR_UNIT - 1.0}
    return torch.tensor([caps.get(name, math.inf) for name in blocks], dtype=_F64).to(device)


@dataclass(frozen=True, slots=True)
class Summary:
    """What the decision reads from a reduced vector, computed in five ops."""

    #: The per-rank blocks as rows of a (blocks x W) view, in ``VectorLayout.PER_RANK`` order.
    blocks: torch.Tensor
    #: Each block's max over the ranks (``hi[0]`` is the global peak).
    hi: torch.Tensor
    #: One bool per name of :attr:`names`: for ``nonfinite`` any rank held one; for ``status``
    #: any rank failed or ranks disagree; for a shared value, it is > 0 (the others: unused).
    flags: torch.Tensor
    #: The names of :attr:`flags`: ``PER_RANK`` then ``SHARED``.
    names: tuple[str, ...]

    def flag(self, name: str) -> torch.Tensor:
        """The 0-dim bool flag of ``name`` (one op)."""
        return self.flags[self.names.index(name)]


def summarize(vec: torch.Tensor, layout: VectorLayout) -> Summary:
    """The flags and per-block maxima of a reduced vector, on its device, without a host read."""
    rows, world = len(layout.PER_RANK), layout.world
    if not vec.is_contiguous():
        vec = vec.contiguous()
    blocks = vec.as_strided((rows, world), (world, 1))
    lo, hi = torch.aminmax(blocks, dim=1)
    margin = hi - torch.minimum(lo, _caps(layout.PER_RANK, vec.device))
    shared = vec.as_strided((len(layout.SHARED),), (1,), vec.storage_offset() + rows * world)
    flags = torch.cat([margin, shared]) > 0
    return Summary(blocks, hi, flags, layout.PER_RANK + layout.SHARED)
