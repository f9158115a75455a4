"""Finding, blocking and importing the plugins that installed distributions list.

[Note: isolation at load]
Every entry point is imported on its own, and *anything* it raises while being
imported (``SystemExit`` from an ``argparse`` run at import time included)
becomes a :class:`LoadFailure` naming the plugin, its distribution and version,
and the fix; the other plugins still load. Output a plugin prints while it is
imported is held back: on success it is passed on unchanged, on failure its
last line goes into the failure (so an ``argparse`` complaint about "unrecognized
arguments" is attributed to the plugin, not shown as if the user's own flags
were wrong).

The one exception that is *not* caught is ``KeyboardInterrupt``: a Ctrl-C while
plugins import is the user asking the program to stop, and a plugin cannot be
told apart from the user. Loading then leaves nothing behind (the registry is
only marked loaded when loading finished), so a later lookup starts over.

[Note: a time limit on import]
A plugin whose import never returns (it waits for a lock, the network or
input) would hang whoever loads plugins. ``shardscale doctor`` and
``shardscale plugins`` must finish, so they load with ``import_timeout``: each
entry point is then imported in a daemon thread that the loader waits for at
most that long. One that does not return in time becomes a ``LoadFailure``
naming it and its distribution; its thread is left running (Python cannot stop
a thread) and ends with the process, and loading goes on with the next plugin.
A program's own loading keeps importing in the calling thread, with no limit:
an import in another thread cannot install signal handlers, and a module left
half-imported there would block the program the first time it imports that
module itself, so the limit is only for commands that report and exit.

[Note: SHARDSCALE_DISABLE_PLUGINS]
A comma-separated list of entry-point names and distribution names. Both sides
are compared in their PEP 503 normalised form (lower case, runs of ``-``, ``_``
and ``.`` as one ``-``), so ``rt-evil-plugin`` (pip's spelling) blocks the
distribution ``RT_Evil.Plugin``. A blocked plugin is never imported, the
built-in one of shardscale-core included: no fallback loads it anyway. Names
that match nothing installed are reported (a warning, and in ``shardscale
plugins`` and ``shardscale doctor``), because a misspelt block fails open.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata as md
import io
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import TextIO

import pluggy

from shardscale.core import _hookspecs

__all__ = [
    "DISABLE_ENV",
    "CORE_DISTRIBUTION",
    "CORE_PLUGIN",
    "LoadFailure",
    "LoadResult",
    "canonical_name",
    "describe_exception",
    "disable_tokens",
    "failure_fix",
    "load_plugins",
]

DISABLE_ENV = "SHARDSCALE_DISABLE_PLUGINS"
#: shardscale-core's own distribution and entry-point name (the only ones core names).
CORE_DISTRIBUTION = "shardscale-core"
CORE_PLUGIN = "core"
_CORE_MODULE = "shardscale.core._plugin"
_UNKNOWN_DIST = "<unknown distribution>"


@dataclass(frozen=True, slots=True)
class LoadFailure:
    """A plugin (or one of its hooks or items) that was set aside, or was blocked by the user.

    ``stage`` says where it failed: ``import``, ``register``, ``conflict``
    (another distribution uses its entry-point name), ``hook`` (a hook raised or
    returned something that is not a list), ``item`` (an item it returned is
    malformed), ``claims``/``supports`` (an adapter's or kernels' check raised
    during a step: the item is no longer consulted), ``observer`` (a
    ``shardscale_on_step`` observer raised: it is no longer called) or
    ``blocked``. ``error`` is one line, never a traceback; ``fix`` says what to do.
    """

    name: str
    distribution: str
    version: str
    error: str
    blocked: bool = False
    fix: str = ""
    stage: str = "import"


@dataclass(slots=True)
class LoadResult:
    """What :func:`load_plugins` registered, what it set aside, and which block names matched nothing."""

    origins: dict[str, tuple[str, str]] = field(default_factory=dict)
    failures: list[LoadFailure] = field(default_factory=list)
    unmatched: tuple[str, ...] = ()
    #: Every entry-point and distribution name seen, for the "matched nothing" message.
    known_names: tuple[str, ...] = ()


def canonical_name(name: str) -> str:
    """The PEP 503 normalised form of a distribution (or entry-point) name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def disable_tokens() -> tuple[str, ...]:
    """The names in ``$SHARDSCALE_DISABLE_PLUGINS``, stripped, in order, without repeats."""
    raw = os.environ.get(DISABLE_ENV, "")
    return tuple(dict.fromkeys(t.strip() for t in raw.split(",") if t.strip()))


def describe_exception(exc: BaseException) -> str:
    """One line naming the exception: never a traceback."""
    if isinstance(exc, SystemExit):
        return (
            f"SystemExit({exc.code!r}): it tried to end the program (does it parse sys.argv "
            "or call sys.exit() when imported or called?)"
        )
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 300:
        first = first[:297] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def failure_fix(name: str, distribution: str) -> str:
    """What a user can do about a plugin that fails."""
    if distribution == "<in-process>":
        return f"fix the plugin object, or unregister it: get_registry().unregister({name!r})"
    if distribution == _UNKNOWN_DIST:
        return f"remove the module that declares it, or block it with {DISABLE_ENV}={name}"
    return (
        f"upgrade or reinstall it (pip install -U {distribution}), uninstall it "
        f"(pip uninstall {distribution}), or block it with {DISABLE_ENV}={name}"
    )


def _matching(tokens: tuple[str, ...], *names: str) -> list[str]:
    wanted = {canonical_name(n) for n in names}
    return [t for t in tokens if canonical_name(t) in wanted]


def _origin(ep: md.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return (_UNKNOWN_DIST, "")
    return (dist.metadata["Name"] or dist.name, dist.version)


def _dist_version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return ""


def _blocked(name: str, dist: str, version: str, hits: list[str]) -> LoadFailure:
    matched = ", ".join(repr(h) for h in hits)
    return LoadFailure(
        name,
        dist,
        version,
        f"blocked by {DISABLE_ENV}",
        blocked=True,
        fix=f"it was not imported, so nothing it provides is here; remove {matched} from "
        f"{DISABLE_ENV} to load it again",
        stage="blocked",
    )


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


class _ImportTimeout(Exception):
    """An entry point's import did not return within the time limit."""


#: Seconds of waiting on one import (with a limit) before the loader says which one it waits for.
_WAIT_NOTICE_S = 3.0


def _load(
    ep: md.EntryPoint, timeout: float | None, dist: str = "", notice: TextIO | None = None
) -> object:
    """``ep.load()``, in a daemon thread waited for ``timeout`` seconds when one is given.

    See [Note: a time limit on import]; whatever the import raises is raised here.
    After ``_WAIT_NOTICE_S`` seconds one line on ``notice`` names the plugin waited for.
    """
    if timeout is None:
        return ep.load()
    outcome: list[tuple[bool, object]] = []

    def target() -> None:
        try:
            outcome.append((True, ep.load()))
        except BaseException as exc:  # handed to the loading thread, KeyboardInterrupt too
            outcome.append((False, exc))

    thread = threading.Thread(target=target, name=f"shardscale-import-{ep.name}", daemon=True)
    thread.start()
    thread.join(min(timeout, _WAIT_NOTICE_S))
    if not outcome and timeout > _WAIT_NOTICE_S:
        if notice is not None:
            source = f" from {dist}" if dist else ""
            print(f"shardscale: waiting for plugin {ep.name!r}{source} to import ({ep.value}); "
                  f"it is given up after {timeout:g} s", file=notice, flush=True)  # fmt: skip
        thread.join(timeout - _WAIT_NOTICE_S)
    if not outcome:
        raise _ImportTimeout(
            f"importing {ep.value} did not return within {timeout:g} s (it may wait for a "
            "lock, the network or input); it was left running and nothing it provides is here"
        )
    ok, value = outcome[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value


def _import(
    ep: md.EntryPoint, timeout: float | None = None, dist: str = ""
) -> tuple[object | None, str]:
    """Import one entry point; return (plugin, "") or (None, a one-line error)."""
    out, err = io.StringIO(), io.StringIO()
    notice = sys.stderr  # the caller's, before the import's output is captured

    def replay() -> None:
        sys.stdout.write(out.getvalue())
        sys.stderr.write(err.getvalue())

    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            plugin = _load(ep, timeout, dist, notice)
    except KeyboardInterrupt:  # the user's Ctrl-C: see [Note: isolation at load]
        replay()
        raise
    except _ImportTimeout as exc:
        error = str(exc)
        printed = _last_line(err.getvalue()) or _last_line(out.getvalue())
        if printed:
            error += f"; it printed {printed!r}"
        return None, error
    except BaseException as exc:  # SystemExit included: see [Note: isolation at load]
        error = describe_exception(exc)
        printed = _last_line(err.getvalue()) or _last_line(out.getvalue())
        if printed:
            error += f"; it printed {printed!r}"
        return None, error
    replay()
    return plugin, ""


def _register(
    pm: pluggy.PluginManager, plugin: object, name: str, dist: str, version: str, result: LoadResult
) -> None:
    try:
        pm.register(plugin, name=name)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        result.failures.append(
            LoadFailure(
                name,
                dist,
                version,
                f"pluggy refused to register it: {describe_exception(exc)}",
                fix=failure_fix(name, dist),
                stage="register",
            )
        )
        return
    result.origins[name] = (dist, version)


def load_plugins(
    pm: pluggy.PluginManager, *, entry_points: bool, import_timeout: float | None = None
) -> LoadResult:
    """Register every installed plugin that is neither blocked nor broken into ``pm``.

    With ``entry_points=False`` only shardscale-core's built-in plugin is
    registered (unless blocked). ``import_timeout``: seconds each entry point's
    import may take (see [Note: a time limit on import]); ``None``: no limit.
    """
    if import_timeout is not None and not 0 < import_timeout <= threading.TIMEOUT_MAX:
        # Above TIMEOUT_MAX every thread join would raise OverflowError, failing every plugin.
        raise ValueError(
            f"import_timeout must be a number of seconds > 0 and <= {threading.TIMEOUT_MAX:g}, "
            f"got {import_timeout!r}"
        )
    tokens = disable_tokens()
    result = LoadResult()
    used: set[str] = set()
    known: list[str] = [CORE_PLUGIN, CORE_DISTRIBUTION]
    by_name: dict[str, list[tuple[md.EntryPoint, str, str]]] = {}
    core_seen = False
    found = md.entry_points(group=_hookspecs.ENTRY_POINT_GROUP) if entry_points else ()
    # First pass: blocks and entry-point names, before anything is imported.
    for ep in found:
        dist, version = _origin(ep)
        known += [ep.name, dist]
        if ep.name == CORE_PLUGIN and canonical_name(dist) == CORE_DISTRIBUTION:
            core_seen = True
        hits = _matching(tokens, ep.name, dist)
        if hits:
            used.update(hits)
            failure = _blocked(ep.name, dist, version, hits)
            if failure not in result.failures:  # the same distribution twice on sys.path
                result.failures.append(failure)
            continue
        same = by_name.setdefault(ep.name, [])
        if any(
            canonical_name(d) == canonical_name(dist) and e.value == ep.value for e, d, _ in same
        ):
            continue  # the same distribution seen twice on sys.path
        same.append((ep, dist, version))
    chosen: list[tuple[md.EntryPoint, str, str]] = []
    for name, candidates in sorted(by_name.items()):
        if len(candidates) == 1:
            chosen.append(candidates[0])
            continue
        chosen += _settle_shared_name(name, candidates, result)
    for ep, dist, version in chosen:
        plugin, error = _import(ep, import_timeout, dist)
        if plugin is None:
            result.failures.append(
                LoadFailure(ep.name, dist, version, error, fix=failure_fix(ep.name, dist))
            )
            continue
        _register(pm, plugin, ep.name, dist, version, result)
    if not core_seen:
        # shardscale-core's metadata is missing (a source tree on PYTHONPATH, or entry points
        # off): its built-in plugin registers by the same path, unless blocked by either name.
        version = _dist_version(CORE_DISTRIBUTION)
        hits = _matching(tokens, CORE_PLUGIN, CORE_DISTRIBUTION)
        if hits:
            used.update(hits)
            result.failures.append(_blocked(CORE_PLUGIN, CORE_DISTRIBUTION, version, hits))
        else:
            plugin = importlib.import_module(_CORE_MODULE)
            _register(pm, plugin, CORE_PLUGIN, CORE_DISTRIBUTION, version, result)
    result.unmatched = tuple(t for t in tokens if t not in used)
    result.known_names = tuple(sorted(set(known), key=str.lower))
    return result


def _settle_shared_name(
    name: str, candidates: list[tuple[md.EntryPoint, str, str]], result: LoadResult
) -> list[tuple[md.EntryPoint, str, str]]:
    """Two distributions use one entry-point name: neither is chosen by discovery order.

    shardscale-core keeps its own name ``core``; otherwise every claimant is set
    aside, with an error naming them all.
    """
    owners = [c for c in candidates if canonical_name(c[1]) == CORE_DISTRIBUTION]
    if name == CORE_PLUGIN and len(owners) == 1:
        for _, dist, version in candidates:
            if canonical_name(dist) != CORE_DISTRIBUTION:
                result.failures.append(
                    LoadFailure(
                        name,
                        dist,
                        version,
                        f"its entry-point name {name!r} is shardscale-core's own; not loaded",
                        fix=f"rename the entry point in {dist}, or uninstall it (pip uninstall {dist})",
                        stage="conflict",
                    )
                )
        return owners
    listed = " and ".join(
        f"{dist} {version} ({ep.value})".strip() for ep, dist, version in candidates
    )
    for _, dist, version in candidates:
        others = [d for _, d, _ in candidates if d != dist] or [dist]
        result.failures.append(
            LoadFailure(
                name,
                dist,
                version,
                f"two installed distributions register the shardscale plugin {name!r}: "
                f"{listed}; neither is loaded",
                fix=f"uninstall one of them, or block one by its distribution name, e.g. "
                f"{DISABLE_ENV}={others[0]}",
                stage="conflict",
            )
        )
    return []
