"""Terminal output: a live progress bar and a summary table, with rich when it is installed.

rich and matplotlib are the optional ``ui`` extra (``pip install 'rich>=13' 'matplotlib>=3.7'``);
without them everything still works, in plain text and without the plot.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TextIO

__all__ = [
    "UI_EXTRA_HINT",
    "have_rich",
    "have_matplotlib",
    "ProgressView",
    "print_table",
]

#: How to get the ui extra's libraries, from a clone or an installed shardscale alike.
UI_EXTRA_HINT = "pip install 'rich>=13' 'matplotlib>=3.7'"


def have_rich() -> bool:
    """Whether rich can be imported."""
    return importlib.util.find_spec("rich") is not None


def have_matplotlib() -> bool:
    """Whether matplotlib can be imported."""
    return importlib.util.find_spec("matplotlib") is not None


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _fmt(value: float | None, digits: int) -> str:
    # None is how JSON carries a non-finite value.
    if value is None or not math.isfinite(value):
        return "inf/nan"
    return f"{value:.{digits}f}"


class ProgressView:
    """Shows training progress: a rich bar with live fields, or one plain line every few steps.

    Use as a context manager and call :meth:`update` once per step with the
    step's fields (``loss``, ``scale``, ``grad_norm``, ``skipped_total``).
    """

    def __init__(
        self, total: int, *, use_rich: bool | None = None, stream: TextIO | None = None
    ) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stdout
        self.use_rich = (have_rich() and _isatty(self.stream)) if use_rich is None else use_rich
        self._progress: Any = None
        self._task: Any = None
        # Plain mode prints about 20 lines per run, plus every skipped step.
        self._every = max(1, total // 20)
        self._ranks = ""
        self._ranks_printed_at = -math.inf

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

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TextColumn("[yellow]{task.fields[ranks]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
                refresh_per_second=4,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(
                "train", total=self.total, stats="starting...", ranks=""
            )
        return self

    def update(
        self,
        *,
        step: int,
        loss: float,
        scale: float,
        grad_norm: float | None,
        skipped: bool,
        skipped_total: int,
    ) -> None:
        """Advance to ``step`` (1-based) and show its numbers."""
        stats = (
            f"loss {_fmt(loss, 4)}  scale {scale:g}  grad-norm {_fmt(grad_norm, 3)}  "
            f"skipped {skipped_total}"
        )
        if self._progress is not None:
            self._progress.update(self._task, completed=step, stats=stats)
            if skipped:
                self._progress.console.print(
                    f"[yellow]step {step}: non-finite gradients at scale {scale:g}, step skipped "
                    "and scale backed off"
                )
            return
        if skipped or step % self._every == 0 or step in (self.total, 1):
            note = "  (overflow: step skipped)" if skipped else ""
            print(f"step {step:>5}/{self.total}  {stats}{note}", file=self.stream, flush=True)

    def ranks(self, text: str) -> None:
        """Show where the ranks are (a slow rank, or each rank's phase); ``""`` hides it.

        The rich bar shows it live; plain output prints it when it changes, at most
        every 10 seconds, so a stalled start or a lagging rank is visible in a log.
        """
        if text == self._ranks:
            return
        self._ranks = text
        if self._progress is not None:
            self._progress.update(self._task, ranks=text)
            return
        now = time.monotonic()
        if text and now - self._ranks_printed_at >= 10.0:
            self._ranks_printed_at = now
            print(f"ranks: {text}", file=self.stream, flush=True)

    def close(self) -> None:
        """Stop drawing (safe to call twice); the context manager calls it."""
        if self._progress is not None:
            self._progress.__exit__(None, None, None)
            self._progress = None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        del exc_type, exc, tb
        self.close()


def print_table(
    title: str,
    rows: Sequence[tuple[str, str]] | Sequence[Sequence[str]],
    *,
    headers: Sequence[str] = ("", ""),
    stream: TextIO | None = None,
    use_rich: bool | None = None,
    right: Sequence[int] = (),
    styles: Sequence[str] = (),
) -> None:
    """Print a small table: a rich Table when rich is there, aligned text otherwise.

    ``styles`` gives each row's first cell a colour (``green``, ``yellow``, ``red``,
    ``dim`` or ``""``), shown only on a terminal: rich's, else ANSI. Piped lines
    carry no colour and no padding after their last cell.
    """
    out = stream if stream is not None else sys.stdout
    # Piped or captured output stays plain text, so scripts can grep it.
    tty = _isatty(out)
    rich_ok = (have_rich() and tty) if use_rich is None else use_rich
    if rich_ok:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        table = Table(title=title, show_header=any(headers))
        for i, header in enumerate(headers):
            table.add_column(header, justify="right" if i in right else "left", overflow="fold")
        for i, row in enumerate(rows):
            cells = [escape(str(c)) for c in row]  # cells are data, not markup
            if i < len(styles) and styles[i] and cells:
                cells[0] = f"[{styles[i]}]{cells[0]}[/]"
            table.add_row(*cells)
        Console(file=out).print(table)
        return
    widths = [max(len(str(r[i])) for r in [tuple(headers), *rows]) for i in range(len(headers))]
    print(title, file=out)
    if any(headers):
        heads = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
        print(heads.rstrip(), file=out)
    for n, row in enumerate(rows):
        cells = [
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        style = styles[n] if n < len(styles) else ""
        if tty and style in _ANSI and cells:
            cells[0] = f"{_ANSI[style]}{cells[0]}\x1b[0m"
        print("  ".join(cells).rstrip(), file=out)
    out.flush()


#: The colours of ``print_table(styles=...)`` as ANSI codes, for terminals without rich.
_ANSI = {"green": "\x1b[32m", "yellow": "\x1b[33m", "red": "\x1b[31m", "dim": "\x1b[2m"}
