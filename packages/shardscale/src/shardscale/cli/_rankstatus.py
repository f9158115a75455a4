"""Where each rank is: a one-line status file per rank, written by the training script.

[Note: seeing a slow rank]
Only rank 0 reports steps on its stdout, and it reports a step after every
rank has finished it (the loss is averaged over ranks). A rank that is slow to
start (importing torch, joining the group) or slow inside a step would be
invisible. With ``--progress-dir DIR`` every rank replaces ``DIR/rank<N>.progress``
with one JSON line ``{"rank", "phase", "step", "steps", "time"}`` when its phase
changes and after every step; ``shardscale demo`` reads them a few times a
second to show the slowest rank and to say where each rank was on a timeout.
A file is replaced atomically (write then rename), so a reader never sees half
a line.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "RankStatus",
    "RankStatusWriter",
    "describe_every_rank",
    "describe_ranks",
    "read_rank_status",
    "status_file",
]


def status_file(directory: Path, rank: int) -> Path:
    """The status file of ``rank`` in ``directory``."""
    return directory / f"rank{rank}.progress"


@dataclass(frozen=True, slots=True)
class RankStatus:
    """One rank's last reported phase (``starting``, ``joining``, ``training``, ...) and step."""

    rank: int
    phase: str
    step: int
    steps: int

    def __str__(self) -> str:
        if self.phase == "training":
            return f"rank {self.rank} step {self.step}/{self.steps}"
        return f"rank {self.rank} {self.phase}"


class RankStatusWriter:
    """Replaces this rank's status file; does nothing when ``directory`` is ``None``."""

    def __init__(self, directory: Path | None, *, rank: int, steps: int) -> None:
        self.path = None if directory is None else status_file(directory, rank)
        self.rank, self.steps = rank, steps

    def update(self, phase: str, step: int = 0) -> None:
        """Record ``phase`` (and the number of finished steps)."""
        if self.path is None:
            return
        line = json.dumps(
            {"rank": self.rank, "phase": phase, "step": step, "steps": self.steps,
             "time": time.time()}
        )  # fmt: skip
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(line + "\n", encoding="utf-8")
            tmp.replace(self.path)
        except OSError:
            pass  # progress display only: never fail training over it


def read_rank_status(directory: Path, world_size: int) -> list[RankStatus | None]:
    """Each rank's last status, or ``None`` for a rank that has written none yet."""
    found: list[RankStatus | None] = []
    for rank in range(world_size):
        try:
            doc = json.loads(status_file(directory, rank).read_text(encoding="utf-8"))
            found.append(RankStatus(rank, str(doc["phase"]), int(doc["step"]), int(doc["steps"])))
        except (OSError, ValueError, KeyError, TypeError):
            found.append(None)
    return found


def describe_every_rank(statuses: list[RankStatus | None]) -> str:
    """Every rank's phase and step, e.g. ``rank 0 step 5/200, rank 1 starting``."""
    return ", ".join(str(s) if s else f"rank {i} starting" for i, s in enumerate(statuses))


def describe_ranks(statuses: list[RankStatus | None]) -> str:
    """A short text naming the slowest rank, or every rank while they are not all training.

    Empty while every rank is training within one step of the others (nothing worth
    showing: the collectives keep healthy ranks in step).
    """
    if not statuses:
        return ""
    training = [s for s in statuses if s is not None and s.phase == "training"]
    if len(training) == len(statuses):
        slowest = min(training, key=lambda s: s.step)
        fastest = max(training, key=lambda s: s.step)
        # One step apart is normal: each rank writes its file when it leaves the step.
        if fastest.step - slowest.step < 2:
            return ""
        return f"slowest: {slowest} (rank {fastest.rank} at {fastest.step})"
    return describe_every_rank(statuses)
