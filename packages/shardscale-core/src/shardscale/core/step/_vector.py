"""The layout of the step's reduced vector: its blocks named once, never as offsets.

See [Note: the reduced vector] in ``_step_engine``: with W ranks each
per-rank block is W float64 values (rank r writes slot r, every other rank
writes 0 there, so a SUM all-reduce is exact), followed by values every rank
adds to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

__all__ = ["STATUS_ERROR_UNIT", "VectorLayout", "pack_status", "unpack_status"]

#: A rank's ``status`` slot is ``code * 2**48 + chain * 2**24 + declarations``: an error code
#: below 2**4 and two 24-bit fingerprints, < 2**52, so every value is an exact float64 integer
#: and the SUM that moves it to every rank (each rank writes only its own slot) stays exact.
_FINGERPRINT = 1 << 24
STATUS_ERROR_UNIT = float(1 << 48)
_CODES = 1 << 4


def pack_status(code: int, chain: float, declarations: float) -> float:
    """One rank's ``status`` value: its error code and its two 24-bit fingerprints."""
    if not (0 <= code < _CODES and 0 <= chain < _FINGERPRINT and 0 <= declarations < _FINGERPRINT):
        raise ValueError(f"status out of range: code={code}, chain={chain}, decl={declarations}")
    return code * STATUS_ERROR_UNIT + float(chain) * _FINGERPRINT + float(declarations)


def unpack_status(value: float) -> tuple[int, float, float]:
    """(error code, chain fingerprint, declarations fingerprint) of a ``status`` value."""
    packed = int(value)
    return packed >> 48, float((packed >> 24) % _FINGERPRINT), float(packed % _FINGERPRINT)


@dataclass(frozen=True, slots=True)
class VectorLayout:
    """Where each block of a W-rank step vector lives."""

    world: int
    #: Shared SUM slots the scaler's third-party skip policies add (``<policy>.<slot>``), after
    #: :attr:`SHARED` (see [Note: a skip policy] in ``_policy``).
    extra: tuple[str, ...] = ()

    #: One slot per rank, in this order.
    PER_RANK: ClassVar[tuple[str, ...]] = (
        "peak",  # M: max over its counted tensors of the tensor's p-norm (finite ones)
        "scaled_sum",  # S: sum_t (n_t / M_r)^p over the same tensors, each term <= 1
        "nonfinite",  # how many of its local gradients hold inf/nan, counted or not
        # Its error code (0: none; _step_errors.ERROR_KINDS) and the 24-bit fingerprints of its
        # backend chain and of what must agree ([Note: declarations]), packed: pack_status.
        "status",
    )
    #: One value every rank adds to.
    SHARED: ClassVar[tuple[str, ...]] = (
        "nan",  # how many local gradients hold nan
        "loss_nonfinite",  # how many ranks observed a non-finite loss (0 where none is held)
    )
    #: The blocks read on the host after the reduction (contiguous: one copy).
    HOST_READ: ClassVar[tuple[str, ...]] = ("status",)

    @property
    def size(self) -> int:
        """How many float64 values the vector holds."""
        return len(self.PER_RANK) * self.world + len(self.SHARED) + len(self.extra)

    def block(self, name: str) -> slice:
        """The W slots of a per-rank block."""
        start = self.PER_RANK.index(name) * self.world
        return slice(start, start + self.world)

    def slot(self, name: str, rank: int) -> int:
        """Rank ``rank``'s slot of a per-rank block."""
        return self.PER_RANK.index(name) * self.world + rank

    def shared(self, name: str) -> int:
        """The index of a shared value (a policy's slot included)."""
        start = len(self.PER_RANK) * self.world
        if name in self.SHARED:
            return start + self.SHARED.index(name)
        return start + len(self.SHARED) + self.extra.index(name)

    def host_read(self) -> slice:
        """The span of :attr:`HOST_READ`, in that order."""
        first, last = self.block(self.HOST_READ[0]), self.block(self.HOST_READ[-1])
        assert last.stop - first.start == len(self.HOST_READ) * self.world  # contiguous
        return slice(first.start, last.stop)
