"""Hook specifications: every kind of shardscale plugin is told apart by the hook it implements.

A plugin is any module or object with functions marked by :data:`hookimpl`.
Installed distributions expose one plugin module each in the ``shardscale``
entry-point group; tests and users may also register objects in-process with
:meth:`shardscale.core.Registry.register`. Each hook that returns items returns
a list (or tuple); the registry calls every plugin's implementation on its own,
and one that raises or returns anything else is recorded as a failure of that
plugin, never of the registry (see ``_registry``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from shardscale.core._protocols import (
        CollectiveBackend,
        GradAdapter,
        StatsKernels,
        StepRecord,
    )
    from shardscale.core.step._policy import SkipPolicy

__all__ = ["PROJECT", "ENTRY_POINT_GROUP", "hookimpl", "HOOK_KINDS"]

PROJECT = "shardscale"
ENTRY_POINT_GROUP = "shardscale"

_hookspec = pluggy.HookspecMarker(PROJECT)
#: Mark plugin functions with ``@hookimpl``; it is re-exported as ``shardscale.core.hookimpl``.
hookimpl = pluggy.HookimplMarker(PROJECT)


@_hookspec
def shardscale_collective_backends() -> Sequence[type[CollectiveBackend]]:  # type: ignore[empty-body]
    """Return a list of backend classes, each with a unique class attribute ``name``.

    A class is instantiated with no arguments when a user selects it, and may
    define a classmethod ``unavailable_reason() -> str | None`` saying why it
    cannot run on this machine (``None``: it can). A class attribute
    ``automatic_priority: int`` offers it for the automatic choice when a
    process group is initialized and no backend is named (the highest wins;
    equal highest values are an error).
    """


@_hookspec
def shardscale_middlewares() -> Sequence[type]:  # type: ignore[empty-body]
    """Return middleware classes, each with a unique ``name``.

    A middleware class is instantiated as ``cls(inner)`` around another backend
    and must itself satisfy the :class:`~shardscale.core.CollectiveBackend`
    protocol. Chains are written left to right: ``counting+coalescing+c10d``.
    """


@_hookspec
def shardscale_grad_adapters() -> Sequence[GradAdapter]:  # type: ignore[empty-body]
    """Return gradient adapter instances (each with ``name`` and ``priority``).

    For every parameter the adapter with the highest priority whose
    ``claims(param)`` is true describes its gradient.
    """


@_hookspec
def shardscale_stats_kernels() -> Sequence[StatsKernels]:  # type: ignore[empty-body]
    """Return statistics/apply kernel instances (each with ``name`` and ``priority``).

    For each device the highest-priority kernel whose ``supports(device)`` is
    true is used, unless the caller names one.
    """


@_hookspec
def shardscale_skip_policies() -> Sequence[type[SkipPolicy]]:  # type: ignore[empty-body]
    """Return skip policy classes (frozen option objects), each with unique class attributes
    ``name`` and ``code`` and an explicit ``precedence``.

    A user builds one with its options and passes it as
    ``ShardedGradScaler(policies=[MyPolicy(...)])``, or looks the class up by
    name (:meth:`~shardscale.core.Registry.policy_class`). See
    :class:`~shardscale.core.SkipPolicy` and docs/skipped-steps.md ("Writing a
    skip policy"): third-party codes are 16..62, precedences 1..29.
    """


@_hookspec
def shardscale_on_step(record: StepRecord) -> None:
    """Observe one finished scaler iteration (called after ``update()``)."""


#: Which hook defines which kind of plugin, as the listing reports it.
HOOK_KINDS: dict[str, str] = {
    "shardscale_collective_backends": "backend",
    "shardscale_middlewares": "middleware",
    "shardscale_grad_adapters": "adapter",
    "shardscale_stats_kernels": "kernels",
    "shardscale_skip_policies": "policy",
    "shardscale_on_step": "observer",
}
