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
bookkeeping (:data:`critical`: appending a record, or a flush) is held until
that returns, so the handler never sees a half-moved buffer. When the last
session closes, the replaced handlers are put back (unless something else has
replaced ours since). Sessions made on other threads still flush at exit.

[Note: a main thread stuck in C]
Python runs a signal handler on the main thread between two bytecodes. A
survivor that torchrun stops is typically stuck inside one C call (a
collective waiting for the dead rank), which may never return: with only a
Python handler, SIGTERM would no longer end it. So where the default would
have ended the process, a watchdog thread learns of the signal through
Python's wakeup file descriptor (written by the C-level handler at once) and,
if the main thread has not started the handler within :data:`GRACE_S`
seconds, flushes the sessions no thread is using (for at most
:data:`FLUSH_LIMIT_S` seconds: a device may be stuck too) and ends the process
by the same signal itself; if the handler did start but its flush is still
running :data:`FLUSH_LIMIT_S` seconds later (stuck on a device sync), it ends
the process all the same. A signal whose default ends the process thus ends it
within ``GRACE_S + FLUSH_LIMIT_S`` seconds, with every row that could be read. The wakeup descriptor is only taken when nothing
else uses it (an asyncio loop's signal handling does); otherwise, and on
Windows, there is no watchdog and a stuck main thread handles the signal when
its C call returns, as it would a Ctrl-C.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["FLUSH_LIMIT_S", "GRACE_S", "SIGNALS", "critical", "install", "uninstall"]

#: The signals handled where the platform has them (Windows has no SIGHUP).
SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)
#: How long the main thread may take to start the handler before the watchdog acts.
GRACE_S = 1.0
#: How long the watchdog's flush may take before the process ends without it.
FLUSH_LIMIT_S = 5.0

_previous: dict[int, Any] = {}
_actions: dict[str, Callable[[], None]] = {}
_local = threading.local()
# Signals whose ending is under way, by the main thread's handler or by the watchdog.
_ending: set[int] = set()
_ending_lock = threading.Lock()
# The watchdog's end of the wakeup pipe, and the write end given to Python (-1: none).
_wakeup_fd = -1


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def install(
    *, flush: Callable[[], None], close: Callable[[], None], flush_idle: Callable[[], None]
) -> None:
    """Handle SIGTERM/SIGHUP: ``flush`` (``close`` when the signal ends the process).

    ``flush_idle`` is the watchdog's flush (see [Note: a main thread stuck in
    C]). A no-op off the main thread, for a signal that is ignored or handled
    outside Python, and for one already handled here.
    """
    if not _on_main_thread():
        return
    _actions.update(flush=flush, close=close, flush_idle=flush_idle)
    for signum in SIGNALS:
        if signum in _previous:
            continue  # ours, or ours replaced by a handler that may chain to it: leave it
        current = signal.getsignal(signum)
        if current is None or current == signal.SIG_IGN:
            continue  # see the Note: nothing we could chain to, or the signal is not wanted
        _previous[signum] = current
        signal.signal(signum, _handle)
    if any(p == signal.SIG_DFL for p in _previous.values()):
        _start_watchdog()


def uninstall() -> None:
    """Put back the handlers :func:`install` replaced (those still ours); main thread only."""
    if not _on_main_thread():
        return
    for signum, previous in list(_previous.items()):
        if signal.getsignal(signum) is _handle:
            signal.signal(signum, previous)
            del _previous[signum]
    _stop_watchdog()


class _Critical:
    """``with critical:`` holds SIGTERM/SIGHUP (on this thread) until the block ends.

    A plain class rather than a generator-based context manager: it runs at
    every step of every session (about 2 us with the session's lock).
    """

    def __enter__(self) -> None:
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _local.depth -= 1
        if _local.depth:
            return
        pending: list[tuple[int, FrameType | None]] = getattr(_local, "pending", [])
        while pending and not _local.depth:
            _deliver(*pending.pop(0))


#: See [Note: flushing on SIGTERM and SIGHUP]: the session's bookkeeping runs inside it.
critical = _Critical()


def _handle(signum: int, frame: FrameType | None) -> None:
    # Runs on the main thread, between two bytecodes of whatever it was doing.
    if getattr(_local, "depth", 0):
        if not hasattr(_local, "pending"):
            _local.pending = []
        _local.pending.append((signum, frame))
        return
    _deliver(signum, frame)


def _claim_ending(signum: int) -> bool:
    with _ending_lock:
        if signum in _ending:
            return False
        _ending.add(signum)
        return True


def _deliver(signum: int, frame: FrameType | None) -> None:
    previous = _previous.get(signum, signal.SIG_DFL)
    ends = previous == signal.SIG_DFL
    if ends and not _claim_ending(signum):
        return  # the watchdog is ending the process already
    with critical:  # a second signal during the flush waits its turn
        _run("close" if ends else "flush", signum)
    if ends:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)  # ends the process as the signal would have
    elif callable(previous):
        previous(signum, frame)


def _run(action: str, signum: int) -> None:
    call = _actions.get(action)
    try:
        if call is not None:
            call()
    except Exception as exc:  # the signal must still go through
        warnings.warn(
            f"shardscale.telemetry: writing the buffered rows on signal {signum} failed: {exc!r}",
            RuntimeWarning,
            stacklevel=3,
        )


# -- the watchdog (see [Note: a main thread stuck in C]) --------------------------------------


def _start_watchdog() -> None:
    global _wakeup_fd
    if _wakeup_fd != -1 or os.name == "nt":
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    taken = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if taken != -1:  # someone else's (an asyncio loop): give it back, go without
        signal.set_wakeup_fd(taken)
        os.close(read_end)
        os.close(write_end)
        return
    _wakeup_fd = write_end
    threading.Thread(
        target=_watch, args=(read_end,), name="shardscale-telemetry-signals", daemon=True
    ).start()


def _stop_watchdog() -> None:
    global _wakeup_fd
    if _wakeup_fd == -1:
        return
    current = signal.set_wakeup_fd(-1)
    if current != _wakeup_fd:  # replaced since: leave the other one in place
        signal.set_wakeup_fd(current)
    os.close(_wakeup_fd)  # the watchdog reads end-of-file and stops
    _wakeup_fd = -1


def _watch(read_end: int) -> None:
    with contextlib.closing(_Fd(read_end)):
        while True:
            try:
                data = os.read(read_end, 64)
            except OSError:
                return
            if not data:
                return
            for signum in set(data):
                if _previous.get(signum) == signal.SIG_DFL:
                    threading.Thread(target=_end_if_stuck, args=(signum,), daemon=True).start()


class _Fd:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _end_if_stuck(signum: int) -> None:
    time.sleep(GRACE_S)
    if _claim_ending(signum):
        flusher = threading.Thread(target=_run, args=("flush_idle", signum), daemon=True)
        flusher.start()
        flusher.join(FLUSH_LIMIT_S)
    else:
        # The main thread's handler started and ends the process once its close returns; a
        # close stuck on a device sync must not keep the process alive either.
        time.sleep(FLUSH_LIMIT_S)
    # signal.signal() is for the main thread only; the C library's resets the disposition
    # from here, so the process ends by this very signal, as the default would have.
    libc = ctypes.CDLL(None)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    libc.signal(signum, None)  # SIG_DFL
    os.kill(os.getpid(), signum)
