"""SIGTERM and SIGHUP write what telemetry has buffered, then do what they would have done.

[Note: flushing on SIGTERM and SIGHUP]
torchrun ends the surviving ranks of a failed job with SIGTERM, and a closed
terminal sends SIGHUP. Neither runs ``atexit``, so up to ``flush_every - 1``
buffered rows per session would be lost, the very steps that explain the
failure. While a session is open, a handler for each is installed (from the
main thread: Python allows no other), chaining the handler it replaces:

* it was the default (the process ends): every session is closed (flushed and
  its observers closed), the default is restored and the signal raised again,
  so the process ends by the same signal, with the same exit status;
* it was a Python handler (yours): every session is flushed, then your
  handler is called with the same arguments and does whatever it did before;
* it was ignored (``SIG_IGN``: ``nohup``'s SIGHUP) or set outside Python: no
  handler is installed, and the signal behaves exactly as before.

A signal that arrives while the main thread is inside a session's own
bookkeeping (:func:`critical`: appending a record, or a flush) is held until
that returns, so the handler never sees a half-moved buffer. When the last
session closes, the replaced handlers are put back (unless something else has
replaced ours since). Sessions made on other threads still flush at exit.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import warnings
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

__all__ = ["SIGNALS", "critical", "install", "uninstall"]

#: The signals handled where the platform has them (Windows has no SIGHUP).
SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)

_previous: dict[int, Any] = {}
_actions: dict[str, Callable[[], None]] = {}
_local = threading.local()


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def install(*, flush: Callable[[], None], close: Callable[[], None]) -> None:
    """Handle SIGTERM/SIGHUP with ``flush`` (or ``close`` when the signal ends the process).

    A no-op off the main thread, for a signal that is ignored or handled
    outside Python, and for one already handled here.
    """
    if not _on_main_thread():
        return
    _actions.update(flush=flush, close=close)
    for signum in SIGNALS:
        if signum in _previous:
            continue  # ours, or ours replaced by a handler that may chain to it: leave it
        current = signal.getsignal(signum)
        if current is None or current == signal.SIG_IGN:
            continue  # see the Note: nothing we could chain to, or the signal is not wanted
        _previous[signum] = current
        signal.signal(signum, _handle)


def uninstall() -> None:
    """Put back the handlers :func:`install` replaced (those still ours); main thread only."""
    if not _on_main_thread():
        return
    for signum, previous in list(_previous.items()):
        if signal.getsignal(signum) is _handle:
            signal.signal(signum, previous)
            del _previous[signum]


@contextlib.contextmanager
def critical() -> Iterator[None]:
    """Hold SIGTERM/SIGHUP (on this thread) until the block ends; see the Note."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        pending: list[tuple[int, FrameType | None]] = getattr(_local, "pending", [])
        while not _local.depth and pending:
            _deliver(*pending.pop(0))


def _handle(signum: int, frame: FrameType | None) -> None:
    # Runs on the main thread, between two bytecodes of whatever it was doing.
    if getattr(_local, "depth", 0):
        if not hasattr(_local, "pending"):
            _local.pending = []
        _local.pending.append((signum, frame))
        return
    _deliver(signum, frame)


def _deliver(signum: int, frame: FrameType | None) -> None:
    previous = _previous.get(signum, signal.SIG_DFL)
    ends = previous == signal.SIG_DFL
    with critical():  # a second signal during the flush waits its turn
        action = _actions.get("close" if ends else "flush")
        try:
            if action is not None:
                action()
        except Exception as exc:  # the signal must still go through
            warnings.warn(
                f"shardscale.telemetry: writing the buffered rows on signal {signum} "
                f"failed: {exc!r}",
                RuntimeWarning,
                stacklevel=2,
            )
    if ends:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)  # ends the process as the signal would have
    elif callable(previous):
        previous(signum, frame)
