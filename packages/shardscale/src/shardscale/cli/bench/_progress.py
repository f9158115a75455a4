"""Progress of a benchmark run: rank 0 writes events to a file, the parent process shows them.

[Note: progress from the ranks]
The ranks run in child processes and print nothing (their output goes to a
log file each, shown only when a rank fails: see ``_launch``). Rank 0 appends
one JSON line per event to a file (:class:`ProgressFile`): a task (``rows``:
the timed rounds of every mesh and optimizer; ``scaling``: the points of the
scaling table; ``points``: the host table's) with what is running, how much
of it is done and its total. The parent polls the file while it waits for
the ranks and shows it (:class:`ProgressView`):

* rich installed and the stream a terminal: a live bar per task, with what is
  running, elapsed time and an estimate of the time left;
* otherwise (no rich, or output to a pipe or file): plain lines, one when a
  task starts a new part (a mesh and optimizer, a point) and at most one
  every 30 s in between, each with the estimate; no control characters.

The estimate is the time per unit so far times the units left; the scaling
table's units are points, the last of which may be skipped for its budget,
so its estimate is capped by that budget.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

__all__ = ["ProgressFile", "ProgressView", "format_seconds", "read_events"]

#: Plain output prints a running task's line at most this often (seconds).
PLAIN_EVERY_S = 30.0


def format_seconds(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``: short, for estimates."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60:02d} s"


class ProgressFile:
    """The writing side (rank 0): one JSON line per event; every other rank writes nothing."""

    def __init__(self, path: str | None, *, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled and path is not None

    def event(
        self, task: str, *, label: str, done: int, total: int, budget_s: float | None = None
    ) -> None:
        """Record that ``done`` of ``total`` units of ``task`` are done, ``label`` running."""
        if not self.enabled or self.path is None:
            return
        line = {"task": task, "label": label, "done": done, "total": total, "budget_s": budget_s}
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")


def read_events(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The complete lines written to ``path`` after byte ``offset``, and the new offset."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
    events = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return events, offset + end


@dataclass
class _Task:
    label: str
    done: int
    total: int
    started: float
    budget_s: float | None = None
    printed_at: float = -math.inf
    printed_label: str = ""

    def left_s(self, now: float) -> float:
        if self.done <= 0 or self.total <= 0:
            return math.nan
        spent = now - self.started
        left = spent / self.done * (self.total - self.done)
        if self.budget_s is not None:
            left = min(left, max(0.0, self.budget_s - spent))
        return left


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class ProgressView:
    """Shows the events of a :class:`ProgressFile` on ``stream`` (see [Note: progress from the ranks])."""

    def __init__(
        self,
        titles: dict[str, str],
        *,
        stream: TextIO | None = None,
        use_rich: bool | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        from shardscale.cli._ui import have_rich

        self.stream = stream if stream is not None else sys.stderr
        self.titles = titles
        self.use_rich = (have_rich() and _isatty(self.stream)) if use_rich is None else use_rich
        self.clock = clock
        self.tasks: dict[str, _Task] = {}
        self._rich: Any = None
        self._ids: dict[str, Any] = {}

    def __enter__(self) -> ProgressView:
        if self.use_rich:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._rich = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=30),
                MofNCompleteColumn(),
                TextColumn("{task.fields[label]}"),
                TextColumn("elapsed"),
                TimeElapsedColumn(),
                TextColumn("about"),
                TimeRemainingColumn(),
                TextColumn("left"),
                console=Console(file=self.stream),
                refresh_per_second=4,
            )
            self._rich.__enter__()
        return self

    def show(self, events: list[dict[str, Any]]) -> None:
        """Take new events into account and redraw (rich) or print what is due (plain)."""
        now = self.clock()
        for ev in events:
            name = str(ev["task"])
            task = self.tasks.get(name)
            if task is None:
                task = self.tasks[name] = _Task(str(ev["label"]), 0, int(ev["total"]), now)
            task.label, task.done, task.total = str(ev["label"]), int(ev["done"]), int(ev["total"])
            task.budget_s = ev.get("budget_s")
            if self._rich is not None:
                self._rich_update(name, task)
        if self._rich is None:
            self._print_due(now)

    def _rich_update(self, name: str, task: _Task) -> None:
        from rich.markup import escape

        if name not in self._ids:
            self._ids[name] = self._rich.add_task(
                self.titles.get(name, name), total=task.total, label=""
            )
        self._rich.update(
            self._ids[name], completed=task.done, total=task.total, label=escape(task.label)
        )

    def _print_due(self, now: float, *, final: bool = False) -> None:
        for name, task in self.tasks.items():
            # A new part (what comes before the label's first colon) prints at once; a round
            # within it waits for the interval; at the end, each task's last state once.
            changed = task.label.split(":")[0] != task.printed_label.split(":")[0]
            if final:
                if task.label == task.printed_label:
                    continue
            elif not changed and now - task.printed_at < PLAIN_EVERY_S:
                continue
            task.printed_at, task.printed_label = now, task.label
            left = task.left_s(now)
            est = f", about {format_seconds(left)} left" if math.isfinite(left) else ""
            title = self.titles.get(name, name)
            print(f"  {title} {task.done}/{task.total}: {task.label} "
                  f"({format_seconds(now - task.started)} so far{est})",
                  file=self.stream, flush=True)  # fmt: skip

    def note(self, text: str) -> None:
        """One line above the bars (or plain)."""
        if self._rich is not None:
            self._rich.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """Stop drawing (safe twice); plain output ends with each task's last state."""
        if self._rich is not None:
            self._rich.__exit__(None, None, None)
            self._rich = None
        elif self.tasks:
            self._print_due(self.clock(), final=True)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        del exc_type, exc, tb
        self.close()
