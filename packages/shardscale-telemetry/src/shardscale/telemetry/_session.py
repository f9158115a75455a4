"""Telemetry sessions: buffer step records, read them in one go, hand rows to observers.

[Note: opt-in]
Installing shardscale-telemetry registers its ``shardscale_on_step`` plugin,
but the plugin writes nothing until a session exists: one made in code with
:func:`enable`, or one made from ``SHARDSCALE_TELEMETRY`` (read once, on the
first step a scaler reports). Sessions are independent (each has its
observers, its flush interval and its ranks), so a program that enables one in
code still gets the one its launcher asked for in the environment.

[Note: what a step costs]
Per step a session on a writing rank appends the record (device tensors) and
the wall-clock time to a list; on other ranks it does nothing. Every
``flush_every`` steps, on :meth:`Telemetry.flush`, :meth:`Telemetry.close` and
at interpreter exit, the buffer is read with one host read per device (see
[Note: one host read per flush]) and the rows go to every observer.
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

from shardscale.telemetry._jsonl import JsonlObserver
from shardscale.telemetry._observer import Observer
from shardscale.telemetry._rows import StepRow, read_rows
from shardscale.telemetry._spec import (
    DEFAULT_FLUSH_EVERY,
    TelemetryConfigError,
    TelemetrySpec,
    spec_from_env,
)

if TYPE_CHECKING:
    from shardscale.core import StepRecord

__all__ = [
    "Telemetry",
    "enable",
    "disable",
    "flush",
    "close_all",
    "reset",
    "sessions",
    "observers_from_spec",
    "dispatch",
]

Ranks = Literal["all"] | int | Iterable[int]


def _global_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    # Not initialised (yet, or never): the launcher's variable, as torchrun sets it.
    raw = os.environ.get("RANK", "0")
    return int(raw) if raw.isdigit() else 0


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
        self._observers: list[Observer] = observers
        self._ranks = _check_ranks(ranks)
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
        with self._lock:
            if self._closed:
                return
            if self._rank is None:
                # Resolved at the first step, when the process group exists.
                self._rank = _global_rank()
                self._writes = self._ranks == "all" or self._rank in self._ranks
            if not self._writes:
                return
            self._records.append(record)
            self._times.append(time.time())
            if len(self._records) >= self.flush_every:
                self.flush()

    def flush(self) -> list[StepRow]:
        """Read the buffered records (one host read) and write them; returns the rows."""
        with self._lock:
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
        with self._lock:
            if self._closed:
                return
            try:
                self.flush()
            finally:
                self._closed = True
                for obs in list(self._observers):
                    self._guard(obs, "close", obs.close)
                with _state_lock:
                    if self in _sessions:
                        _sessions.remove(self)


_state_lock = threading.RLock()
_sessions: list[Telemetry] = []
# The environment's session: not read yet, read and off (None), or the session.
_ENV_UNREAD = object()
_env_session: object = _ENV_UNREAD


def observers_from_spec(spec: TelemetrySpec) -> list[Observer]:
    """The observers a parsed ``SHARDSCALE_TELEMETRY`` names (builds nothing on disk)."""
    out: list[Observer] = []
    for sink in spec.sinks:
        if sink.kind == "jsonl":
            assert sink.target is not None
            out.append(JsonlObserver(sink.target))
        elif sink.kind == "tensorboard":
            from shardscale.telemetry._tensorboard import TensorBoardObserver

            assert sink.target is not None
            out.append(TensorBoardObserver(sink.target))
        elif sink.kind == "wandb":
            from shardscale.telemetry._wandb import WandbObserver

            out.append(WandbObserver(sink.target))
        else:  # pragma: no cover - parse_spec admits only the kinds above
            raise TelemetryConfigError(f"unknown observer {sink.kind!r}")
    return out


def _ensure_plugin() -> None:
    # A session is fed by the plugin's hook: if the entry point was blocked, say so.
    from shardscale.core import get_registry

    reg = get_registry()
    if any(p.name == "telemetry" for p in reg.plugins()):
        return
    blocked = [f for f in reg.failures() if f.distribution == "shardscale-telemetry"]
    if blocked:
        warnings.warn(
            f"shardscale.telemetry.enable(): the telemetry plugin did not load "
            f"({blocked[0].error}), so no scaler step reaches this session",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    # Not installed as a distribution (a source checkout): register the same module in-process.
    from shardscale.telemetry import _plugin

    reg.register(_plugin, name="telemetry")


def enable(
    *observers: Observer,
    flush_every: int = DEFAULT_FLUSH_EVERY,
    ranks: Ranks = 0,
) -> Telemetry:
    """Start a telemetry session: every scaler step from now on goes to ``observers``.

    ``flush_every`` steps are buffered between host reads; ``ranks`` chooses
    the writing global ranks (``0`` by default, ``"all"``, or a collection).
    Returns the session; ``session.close()`` (or :func:`disable`, or the end
    of the process) writes what is left. Example::

        from shardscale import telemetry
        telemetry.enable(telemetry.JsonlObserver("runs/steps.jsonl"),
                         telemetry.TensorBoardObserver("runs/tb"), flush_every=50)
    """
    session = Telemetry(observers, flush_every=flush_every, ranks=ranks)
    _ensure_plugin()
    with _state_lock:
        _sessions.append(session)
    return session


def _env_session_once() -> None:
    global _env_session
    with _state_lock:
        if _env_session is not _ENV_UNREAD:
            return
        spec = spec_from_env()  # raises on a bad value, on every step, until it is fixed
        if spec is None:
            _env_session = None
            return
        session = Telemetry(
            observers_from_spec(spec), flush_every=spec.flush_every, ranks=spec.ranks
        )
        _sessions.append(session)
        _env_session = session


def dispatch(record: StepRecord) -> None:
    """Hand one step record to every session (the plugin's ``shardscale_on_step``)."""
    _env_session_once()
    for session in list(_sessions):
        session.observe(record)


def sessions() -> tuple[Telemetry, ...]:
    """The open sessions: those from :func:`enable` and the one ``SHARDSCALE_TELEMETRY`` made."""
    with _state_lock:
        return tuple(_sessions)


def flush() -> None:
    """Flush every open session now (one host read each)."""
    for session in sessions():
        session.flush()


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
