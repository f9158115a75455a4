"""Exceptions raised by shardscale.

Every error names what was wrong and how to fix it; none of them leaves a
scaler, an optimizer or a gradient half-changed.
"""

from __future__ import annotations

__all__ = [
    "ShardscaleError",
    "PluginNotFoundError",
    "PluginConflictError",
    "BackendUnavailableError",
    "LayoutError",
    "ObserverSettingError",
    "GradientDtypeError",
    "DeclarationError",
    "SkipStreakError",
    "PluginWarning",
]


class ShardscaleError(RuntimeError):
    """Base class of every error shardscale raises on purpose."""


class PluginNotFoundError(ShardscaleError, KeyError):
    """A plugin was asked for by a name that no installed plugin provides."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class PluginConflictError(ShardscaleError):
    """Two plugins claim the same name."""


class BackendUnavailableError(ShardscaleError):
    """A collective backend exists but cannot run here (e.g. nccl without CUDA)."""


class LayoutError(ShardscaleError, ValueError):
    """Gradients are laid out in a way no adapter can combine into one global value."""


class ObserverSettingError(ShardscaleError):
    """A step observer's own setting is wrong (not the observer): raise it from ``shardscale_on_step``.

    The registry records it as the plugin's failure and warns once, like any
    observer that raises, but keeps calling the observer: the bad setting
    switches off only what it configures (shardscale-telemetry raises it for a
    bad ``SHARDSCALE_TELEMETRY`` and keeps feeding the sessions started in
    code). An observer raises it once, not at every step. A ``fix`` string
    attribute, if present, is shown as the fix.
    """


class GradientDtypeError(ShardscaleError, TypeError):
    """A gradient that is not real floating point (integer, bool, complex)."""


class DeclarationError(ShardscaleError, ValueError):
    """A ``distinct_dims``/``distinct_params`` declaration that does not fit the step's
    parameters, or that differs between the ranks of one step."""


class SkipStreakError(ShardscaleError):
    """Too many consecutive optimizer steps were skipped (``policies=[SkipStreakLimit(max_skips=N)]``).

    Raised on every rank by ``ShardedGradScaler.update()`` (at the latest by the
    scaler's next call, one step later on an accelerator) once the streak of
    skipped steps reaches the limit. ``step`` is the scaler step that reached
    it, ``streak`` how many consecutive steps were skipped, ``reasons`` the
    ``SkipReason`` values seen in the streak.
    """

    def __init__(self, message: str, *, step: int, streak: int, reasons: tuple[int, ...]) -> None:
        super().__init__(message)
        self.step = step
        self.streak = streak
        self.reasons = reasons


class PluginWarning(UserWarning):
    """A plugin failed (and was set aside) or ``SHARDSCALE_DISABLE_PLUGINS`` matched nothing.

    Training goes on without the failed plugin; ``shardscale plugins`` and
    ``shardscale doctor`` list every such failure with its fix.
    """
