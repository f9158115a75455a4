"""The TensorBoard observer: scalars in event files, written with tensorboard's own writer."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardscale.telemetry._errors import TelemetryConfigError
from shardscale.telemetry._paths import check_path_template, rank_path
from shardscale.telemetry._rows import reason_code

if TYPE_CHECKING:
    from shardscale.telemetry._rows import StepRow

__all__ = ["TensorBoardObserver", "TENSORBOARD_TAGS", "tensorboard_unavailable_reason"]

#: The scalar tags written for every step (after ``prefix``); ``grad_norm`` and
#: ``hysteresis_tracker`` only where the scaler provides them.
TENSORBOARD_TAGS = (
    "scale",
    "skipped",
    "skipped_total",
    "grad_norm",
    "growth_tracker",
    "hysteresis_tracker",
    "overflow_ranks",
    "skip_reason",
)
_EXTRA = "pip install 'shardscale-telemetry[tensorboard]'"


def tensorboard_unavailable_reason() -> str | None:
    """Why the TensorBoard observer cannot run here (``None``: it can)."""
    try:
        import tensorboard.summary.writer.event_file_writer  # noqa: F401
    except ImportError as exc:
        return f"the tensorboard package is missing ({exc}): {_EXTRA}"
    return None


class TensorBoardObserver:
    """Writes each step's scalars under ``log_dir`` (``tensorboard --logdir`` reads them).

    Tags are ``<prefix>scale``, ``skipped`` (0/1), ``skipped_total``,
    ``grad_norm`` (when ``unscale_and_clip_`` ran), ``growth_tracker``,
    ``hysteresis_tracker``, ``overflow_ranks`` (how many ranks held
    non-finite gradients) and ``skip_reason`` (the
    :class:`~shardscale.core.SkipReason` value, 0 on a step taken), one value
    per step each. ``{rank}`` in ``log_dir``
    is replaced by the writing rank. Needs the ``tensorboard`` package
    (``pip install 'shardscale-telemetry[tensorboard]'``), not TensorFlow.
    """

    name = "tensorboard"

    def __init__(self, log_dir: str | os.PathLike[str], *, prefix: str = "shardscale/") -> None:
        self._template = check_path_template(log_dir, what="TensorBoardObserver")
        reason = tensorboard_unavailable_reason()
        if reason is not None:
            raise TelemetryConfigError(f"the TensorBoard observer cannot run: {reason}")
        if not isinstance(prefix, str):
            raise TelemetryConfigError(f"prefix must be a string, got {prefix!r}")
        self._prefix = prefix
        self._writer: Any = None
        self._skipped_total = 0
        self.log_dir: Path | None = None

    def __repr__(self) -> str:
        return f"TensorBoardObserver({self._template!r})"

    @property
    def path_template(self) -> str:
        """The folder as given, ``{rank}`` not yet replaced."""
        return self._template

    def open(self, rank: int) -> None:
        """Create ``log_dir`` for ``rank`` and a new event file in it."""
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        path = rank_path(self._template, rank)
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(f"the TensorBoard observer's log_dir {path} is a file")
        path.mkdir(parents=True, exist_ok=True)
        # Long flush interval: write() flushes itself, once per flush of the session.
        self._writer = EventFileWriter(str(path), max_queue_size=1024, flush_secs=3600)
        self.log_dir = path

    def write(self, rows: Sequence[StepRow]) -> None:
        """One event per step holding every tag's value, then a flush to disk."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        if self._writer is None:
            raise RuntimeError("TensorBoardObserver.write() before open(): a session opens it")
        p = self._prefix
        for row in rows:
            self._skipped_total += int(row.skipped)
            values = {
                "scale": row.scale,
                "skipped": float(row.skipped),
                "skipped_total": float(self._skipped_total),
                "grad_norm": row.grad_norm,
                "growth_tracker": float(row.growth_tracker),
                "hysteresis_tracker": (
                    None if row.hysteresis_tracker is None else float(row.hysteresis_tracker)
                ),
                "overflow_ranks": float(len(row.overflow_ranks)),
                "skip_reason": float(reason_code(row.skip_reason)),
            }
            summary = Summary(
                value=[
                    Summary.Value(tag=p + tag, simple_value=v)
                    for tag, v in values.items()
                    if v is not None
                ]
            )
            self._writer.add_event(Event(wall_time=row.time, step=row.step, summary=summary))
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (a no-op if it was never opened)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
