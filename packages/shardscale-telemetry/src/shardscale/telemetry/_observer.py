"""The contract every telemetry observer implements (JSONL, TensorBoard, W&B, or yours)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from shardscale.telemetry._rows import StepRow

__all__ = ["Observer"]


@runtime_checkable
class Observer(Protocol):
    """Writes rows of step telemetry somewhere.

    An observer touches nothing (no file, no run) until :meth:`open`, which a
    :class:`~shardscale.telemetry.Telemetry` session calls on a rank that
    writes, just before the first :meth:`write`; so every rank may build the
    same observers and only the writing ranks create files.
    """

    def open(self, rank: int) -> None:
        """Prepare to write as global rank ``rank`` (create the file, folder or run)."""
        ...

    def write(self, rows: Sequence[StepRow]) -> None:
        """Write ``rows`` (consecutive steps, oldest first) and make them visible to readers."""
        ...

    def close(self) -> None:
        """Write anything pending and release the file or run (called once, at the end)."""
        ...
