"""Telemetry sessions: buffer step records, read them in one go, hand rows to observers.

[Note: opt-in]
Installing shardscale-telemetry registers its ``shardscale_on_step`` plugin,
but the plugin writes nothing until a session exists: one made in code with
:func:`enable`, or one made from ``SHARDSCALE_TELEMETRY`` (read once, on the
first step a scaler reports). Sessions are independent (each has its
observers, its flush interval and its ranks), so a program that enables one in
code still gets the one its launcher asked for in the environment, and a bad
variable turns off only the environment's session: the error is raised once,
after the step has reached the other sessions, as an
:class:`~shardscale.core.ObserverSettingError`, which the registry records as
the plugin's failure while still calling it.

[Note: what a step costs]
Per step a session on a writing rank appends the record (device tensors) and
the wall-clock time to a list; on other ranks it does nothing. Every
``flush_every`` steps, on :meth:`Telemetry.flush`, :meth:`Telemetry.close`, at
interpreter exit and on SIGTERM/SIGHUP (see [Note: flushing on SIGTERM and
SIGHUP] in ``_signals``), the buffer is read with one host read per device
(see [Note: one host read per flush]) and the rows go to every observer.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

from shardscale.telemetry import _signals
from shardscale.telemetry._errors import TelemetryConfigError
from shardscale.telemetry._kinds import OBSERVER_KINDS, kind_of, per_rank_problem
from shardscale.telemetry._observer import Observer
from shardscale.telemetry._rows import StepRow, read_rows
from shardscale.telemetry._spec import DEFAULT_FLUSH_EVERY, ENV, TelemetrySpec, spec_from_env

if TYPE_CHECKING:
    from shardscale.core import StepRecord

__all__ = [
    "Telemetry",
    "Ranks",
    "disable",
    "flush",
    "close_all",
    "reset",
    "sessions",
    "observers_from_spec",
    "dispatch",
]

Ranks = Literal["all"] | int | Iterable[int]


def _launch_value(name: str, default: int) -> int:
    # Not initialised (yet, or never): the launcher's variables, as torchrun sets them.
    raw = os.environ.get(name, "")
    return int(raw) if raw.isdigit() else default


def _global_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _launch_value("RANK", 0)


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return max(1, _launch_value("WORLD_SIZE", 1))


def _check_ranks(ranks: Ranks) -> Literal["all"] | frozenset[int]:
    if ranks == "all":
        return "all"
    if isinstance(ranks, bool) or not isinstance(ranks, int | Iterable) or isinstance(ranks, str):
        raise TelemetryConfigError(
            f"ranks must be 'all', a global rank number or a collection of them, got {ranks!r}"
        )
    chosen = frozenset([ranks] if isinstance(ranks, int) else ranks)
    bad = [r for r in chosen if isinstance(r, bool) or not isinstance(r, int) or r < 0]
    if bad or not chosen:
        raise TelemetryConfigError(
            f"ranks must name global ranks >= 0 (or be 'all'), got {ranks!r}; e.g. ranks=0"
        )
    return chosen


def _ranks_text(ranks: Literal["all"] | frozenset[int]) -> str:
    return "all" if ranks == "all" else str(sorted(ranks))


def _check_per_rank(observers: Sequence[Observer], ranks: Literal["all"] | frozenset[int]) -> None:
    # Several writing ranks must not share a file: the variable's rule and text, see
    # [Note: one writer per file] in _kinds.
    if ranks != "all" and len(ranks) < 2:
        return
    for obs in observers:
        kind = kind_of(obs)
        if kind is None or not kind.per_rank:
            continue
        problem = per_rank_problem(kind, str(getattr(obs, "path_template", "")), _ranks_text(ranks))
        if problem is not None:
            raise TelemetryConfigError(f"a telemetry session with {obs!r}: {problem}")


class Telemetry:
    """A set of observers fed with every step a scaler reports, on the chosen ranks.

    Build one with :func:`enable` (which also starts it). ``flush_every`` is
    how many steps are buffered before the one host read that turns them into
    rows; ``ranks`` which global ranks write (``0``, a collection, or
    ``"all"``). Also a context manager: leaving it closes the session.
    """

    def __init__(
        self,
        observers: Sequence[Observer],
        *,
        flush_every: int = DEFAULT_FLUSH_EVERY,
        ranks: Ranks = 0,
    ) -> None:
        if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise TelemetryConfigError(
                f"flush_every must be a whole number of steps >= 1, got {flush_every!r}"
            )
        observers = list(observers)
        if not observers:
            raise TelemetryConfigError(
                "a telemetry session needs at least one observer, e.g. "
                "enable(JsonlObserver('runs/steps.jsonl'))"
            )
        for obs in observers:
            if not isinstance(obs, Observer):
                raise TelemetryConfigError(
                    f"{obs!r} is not an observer: it needs open(rank), write(rows) and close() "
                    "(see shardscale.telemetry.Observer)"
                )
        self._ranks = _check_ranks(ranks)
        _check_per_rank(observers, self._ranks)
        self._observers: list[Observer] = observers
        self.flush_every = flush_every
        self._lock = threading.RLock()
        self._records: list[StepRecord] = []
        self._times: list[float] = []
        self._rank: int | None = None
        self._writes = False
        self._opened = False
        self._closed = False
        self.rows_written = 0

    def __repr__(self) -> str:
        return (
            f"Telemetry({self._observers!r}, flush_every={self.flush_every}, "
            f"ranks={self._ranks if self._ranks == 'all' else sorted(self._ranks)!r})"
        )

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def observers(self) -> tuple[Observer, ...]:
        """The observers still writing (one that failed is dropped with a warning)."""
        return tuple(self._observers)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def observe(self, record: StepRecord) -> None:
        """Keep ``record`` (no host read); flush when ``flush_every`` records are buffered."""
        with self._lock, _signals.critical:
            if self._closed:
                return
            if self._rank is None:
                # Resolved at the first step, when the process group exists.
                self._rank = _global_rank()
                self._writes = self._ranks == "all" or self._rank in self._ranks
                self._warn_missing_ranks()
            if not self._writes:
                return
            self._records.append(record)
            self._times.append(time.time())
            if len(self._records) >= self.flush_every:
                self.flush()

    def _warn_missing_ranks(self) -> None:
        # A rank number beyond the world writes nothing: say so once, on global rank 0.
        if self._ranks == "all" or self._rank != 0:
            return
        world = _world_size()
        missing = sorted(r for r in self._ranks if r >= world)
        if not missing:
            return
        named = ", ".join(map(str, missing))
        outcome = (
            "nothing is written" if len(missing) == len(self._ranks) else "those write nothing"
        )
        warnings.warn(
            f"shardscale.telemetry: {self!r} selects rank {named}, but this run has world size "
            f"{world} (global ranks 0 to {world - 1}), so {outcome}; pass ranks=0 (a rank "
            f"below {world}) or ranks='all' (in {ENV}: ranks=0 or ranks=all)",
            RuntimeWarning,
            stacklevel=2,
        )

    def flush(self) -> list[StepRow]:
        """Read the buffered records (one host read) and write them; returns the rows."""
        with self._lock, _signals.critical:
            if not self._records:
                return []
            assert self._rank is not None
            records, times = self._records, self._times
            self._records, self._times = [], []
            rows = read_rows(records, rank=self._rank, times=times)
            if not self._opened:
                self._opened = True
                for obs in list(self._observers):
                    self._guard(obs, "open", lambda o=obs: o.open(self._rank or 0))
                # Again now that observers may have started libraries with their own exit
                # hooks (wandb): ours run first, while those libraries still work.
                atexit.register(close_all)
            for obs in list(self._observers):
                self._guard(obs, "write", lambda o=obs: o.write(rows))
            self.rows_written += len(rows)
            return rows

    def _guard(self, obs: Observer, what: str, call: object) -> None:
        try:
            call()  # type: ignore[operator]
        except Exception as exc:
            # Telemetry must never stop training: say so loudly and drop this observer.
            self._observers.remove(obs)
            warnings.warn(
                f"shardscale.telemetry: observer {obs!r} failed in {what}() and is turned off "
                f"for the rest of this run ({type(exc).__name__}: {exc}); the other observers "
                "keep writing.",
                RuntimeWarning,
                stacklevel=2,
            )
            with contextlib.suppress(Exception):
                obs.close()  # best effort: it already failed once

    def close(self) -> None:
        """Flush what is buffered, close every observer and stop observing (idempotent)."""
        with self._lock, _signals.critical:
            if self._closed:
                return
            try:
                self.flush()
            finally:
                self._closed = True
                for obs in list(self._observers):
                    self._guard(obs, "close", obs.close)
                _remove(self)


_state_lock = threading.RLock()
_sessions: list[Telemetry] = []
# The environment's session: not read yet, read and off (None), or the session.
_ENV_UNREAD = object()
_env_session: object = _ENV_UNREAD


def add_session(session: Telemetry) -> None:
    """Feed ``session`` every step from now on (and flush it on SIGTERM/SIGHUP)."""
    with _state_lock:
        _sessions.append(session)
    _signals.install(flush=flush, close=close_all, flush_idle=_flush_idle)


def _remove(session: Telemetry) -> None:
    with _state_lock:
        if session in _sessions:
            _sessions.remove(session)
        last = not _sessions
    if last:
        _signals.uninstall()


def observers_from_spec(spec: TelemetrySpec) -> list[Observer]:
    """The observers a parsed ``SHARDSCALE_TELEMETRY`` names (builds nothing on disk)."""
    return [OBSERVER_KINDS[sink.kind].build(sink.target) for sink in spec.sinks]


def _env_session_once() -> TelemetryConfigError | None:
    """Read the variable on the first step; its error is returned that once (then it is off)."""
    global _env_session
    with _state_lock:
        if _env_session is not _ENV_UNREAD:
            return None
        _env_session = None
        try:
            spec = spec_from_env()
            if spec is None:
                return None
            session = Telemetry(
                observers_from_spec(spec), flush_every=spec.flush_every, ranks=spec.ranks
            )
        except TelemetryConfigError as exc:
            return exc
    add_session(session)
    _env_session = session
    return None


def dispatch(record: StepRecord) -> None:
    """Hand one step record to every session (the plugin's ``shardscale_on_step``).

    A bad ``SHARDSCALE_TELEMETRY`` is raised once, after the record reached
    every session (see [Note: opt-in]).
    """
    problem = _env_session_once()
    for session in list(_sessions):
        session.observe(record)
    if problem is not None:
        raise problem


def sessions() -> tuple[Telemetry, ...]:
    """The open sessions: those from :func:`enable` and the one ``SHARDSCALE_TELEMETRY`` made."""
    with _state_lock:
        return tuple(_sessions)


def flush() -> None:
    """Flush every open session now (one host read each)."""
    for session in sessions():
        session.flush()


def _flush_idle() -> None:
    # For a signal that arrived while the main thread is stuck (see _signals): flush only the
    # sessions no thread is using, since one in use may be the stuck one.
    for session in sessions():
        if session._lock.acquire(blocking=False):
            try:
                session.flush()
            finally:
                session._lock.release()


def close_all() -> None:
    """Close every session (they flush first); runs at interpreter exit."""
    for session in sessions():
        try:
            session.close()
        except Exception as exc:  # at exit: one failing session must not hide the others
            warnings.warn(
                f"shardscale.telemetry: closing {session!r} failed: {exc!r}",
                RuntimeWarning,
                stacklevel=2,
            )


def disable() -> None:
    """Close every session, the environment's included, and ignore ``SHARDSCALE_TELEMETRY``
    for the rest of the process (call :func:`reset` to read it again)."""
    global _env_session
    close_all()
    with _state_lock:
        _env_session = None


def reset() -> None:
    """Close every session and forget the environment was read (tests, notebooks)."""
    global _env_session
    close_all()
    with _state_lock:
        _env_session = _ENV_UNREAD


atexit.register(close_all)
