"""``enable()``: start a telemetry session, and make sure the plugin that feeds it is registered.

Above both the sessions and the plugin module (which feeds the sessions), so
neither imports the other back.
"""

from __future__ import annotations

import warnings

from shardscale.telemetry import _plugin
from shardscale.telemetry._observer import Observer
from shardscale.telemetry._session import Ranks, Telemetry, add_session
from shardscale.telemetry._spec import DEFAULT_FLUSH_EVERY

__all__ = ["enable"]


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
    add_session(session)
    return session
