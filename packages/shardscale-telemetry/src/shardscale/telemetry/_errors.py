"""The one error telemetry raises for a bad setting (an argument or the environment variable)."""

from __future__ import annotations

from shardscale.core import ObserverSettingError

__all__ = ["TelemetryConfigError"]


class TelemetryConfigError(ValueError, ObserverSettingError):
    """A telemetry setting (the environment variable or an ``enable`` argument) is invalid.

    Raised at once by :func:`~shardscale.telemetry.enable` and the observers'
    constructors. A bad ``SHARDSCALE_TELEMETRY`` is found at the first scaler
    step instead, where the registry records it as the telemetry plugin's
    failure (an :class:`~shardscale.core.ObserverSettingError`: sessions
    started in code keep writing).
    """

    #: Shown by ``shardscale plugins``/``doctor`` when the registry records the variable's error.
    fix = (
        "correct SHARDSCALE_TELEMETRY as the message shows (or unset it to turn telemetry off); "
        "`shardscale doctor` checks it"
    )
