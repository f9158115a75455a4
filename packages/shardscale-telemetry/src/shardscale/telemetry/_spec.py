"""``SHARDSCALE_TELEMETRY``: turning telemetry on without changing code (for ``torchrun``).

[Note: the environment variable's syntax]
A comma-separated list of entries, each either an *observer* or an *option*::

    SHARDSCALE_TELEMETRY=jsonl:runs/steps.jsonl,tensorboard:runs/tb,every=50
    SHARDSCALE_TELEMETRY=wandb:my-project,ranks=all

Observers are the kinds of ``_kinds.OBSERVER_KINDS``: ``jsonl:PATH`` (a file),
``tensorboard:DIR`` (a folder of event files) and ``wandb`` or
``wandb:PROJECT``. Options are ``every=N`` (read the
device and write every N steps; default 100; the end of the process always
writes what is left) and ``ranks=all`` or ``ranks=N`` (which global rank
writes; default 0). With ``ranks=all`` every file or folder must contain
``{rank}``, replaced by the writing rank, so ranks never share a file (see
[Note: one writer per file] in ``_kinds``). Paths
may not contain commas. Empty or ``off`` means off. Anything else is an error
that names the entry and shows a valid spelling, raised on the first scaler
``update()`` on every rank alike (the variable is the same on every rank).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

from shardscale.telemetry._errors import TelemetryConfigError
from shardscale.telemetry._kinds import OBSERVER_KINDS, per_rank_problem

__all__ = [
    "ENV",
    "DEFAULT_FLUSH_EVERY",
    "SinkSpec",
    "TelemetrySpec",
    "parse_spec",
    "spec_from_env",
]

ENV = "SHARDSCALE_TELEMETRY"
DEFAULT_FLUSH_EVERY = 100
_OPTIONS = ("every", "ranks")
_EXAMPLE = f"{ENV}=jsonl:runs/steps.jsonl,tensorboard:runs/tb,every=50"
_OPTION_RE = re.compile(r"^([A-Za-z_]+)=(.*)$")
_SINK_RE = re.compile(r"^([A-Za-z_]+)(?::(.*))?$", re.DOTALL)


@dataclass(frozen=True, slots=True)
class SinkSpec:
    """One observer named in the variable: ``kind`` and its target (path, folder or project)."""

    kind: str
    target: str | None


@dataclass(frozen=True, slots=True)
class TelemetrySpec:
    """The parsed variable: which observers, how often to flush, and which ranks write."""

    sinks: tuple[SinkSpec, ...]
    flush_every: int = DEFAULT_FLUSH_EVERY
    ranks: Literal["all"] | int = 0


def _fail(text: str, problem: str) -> TelemetryConfigError:
    return TelemetryConfigError(f"{ENV}={text!r}: {problem}. Example: {_EXAMPLE}")


def _parse_option(text: str, key: str, value: str) -> tuple[str, int | str]:
    if key == "every":
        if not re.fullmatch(r"[0-9]+", value.strip()) or int(value) < 1:
            raise _fail(
                text, f"every={value!r} must be a whole number of steps >= 1 (e.g. every=50)"
            )
        return key, int(value)
    if key == "ranks":
        v = value.strip()
        if v == "all":
            return key, "all"
        if re.fullmatch(r"[0-9]+", v):
            return key, int(v)
        raise _fail(text, f"ranks={value!r} must be 'all' or one global rank number (e.g. ranks=0)")
    raise _fail(
        text,
        f"unknown option {key!r}; options are {', '.join(o + '=' for o in _OPTIONS)} "
        f"and observers are {', '.join(OBSERVER_KINDS)}",
    )


def parse_spec(text: str) -> TelemetrySpec | None:
    """Parse the variable's value (see the note); ``None`` when it turns telemetry off.

    Raises :class:`TelemetryConfigError` naming the bad entry and showing a valid one.
    """
    stripped = text.strip()
    if not stripped or stripped.lower() == "off":
        return None
    sinks: list[SinkSpec] = []
    options: dict[str, int | str] = {}
    for raw in stripped.split(","):
        entry = raw.strip()
        if not entry:
            raise _fail(text, "an empty entry (two commas in a row, or a trailing comma)")
        option = _OPTION_RE.match(entry)
        if option is not None:
            key, value = _parse_option(text, option.group(1), option.group(2))
            if key in options:
                raise _fail(text, f"the option {key}= is given twice")
            options[key] = value
            continue
        sink = _SINK_RE.match(entry)
        name = sink.group(1) if sink is not None else entry
        kind = OBSERVER_KINDS.get(name)
        if sink is None or kind is None:
            raise _fail(
                text,
                f"unknown observer {name!r} in {entry!r}: observers are "
                f"{', '.join(OBSERVER_KINDS)} (written "
                f"{', '.join(k.spelling for k in OBSERVER_KINDS.values())}) "
                "and options are every=N, ranks=all|N",
            )
        target = sink.group(2)
        if target is not None:
            target = target.strip() or None
        if kind.required and target is None:
            raise _fail(text, f"{name} needs a {kind.target} path: write {name}:{kind.example}")
        if any(s.kind == name for s in sinks):
            raise _fail(text, f"the observer {name} is given twice; give each observer once")
        sinks.append(SinkSpec(name, target))
    if not sinks:
        raise _fail(text, "options but no observer; add e.g. jsonl:runs/steps.jsonl")
    ranks = options.get("ranks", 0)
    if ranks == "all":
        for s in sinks:
            problem = per_rank_problem(OBSERVER_KINDS[s.kind], s.target or "", "all")
            if problem is not None:
                raise _fail(text, problem)
    flush_every = options.get("every", DEFAULT_FLUSH_EVERY)
    assert isinstance(flush_every, int)
    chosen: Literal["all"] | int = "all" if ranks == "all" else int(ranks)
    return TelemetrySpec(tuple(sinks), flush_every=flush_every, ranks=chosen)


def spec_from_env() -> TelemetrySpec | None:
    """Parse ``SHARDSCALE_TELEMETRY`` from the environment (``None``: unset or off)."""
    return parse_spec(os.environ.get(ENV, ""))
