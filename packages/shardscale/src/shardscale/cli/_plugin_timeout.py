"""``--plugin-timeout``: the time limit on each plugin's import for the commands that must finish.

``shardscale doctor`` and ``shardscale plugins`` report on plugins, broken ones
included, so a plugin whose import never returns must become a finding, not a
hang (see [Note: a time limit on import] in ``shardscale.core._plugin_loading``).
"""

from __future__ import annotations

import argparse
import math

__all__ = ["DEFAULT_PLUGIN_TIMEOUT", "add_plugin_timeout_option", "load_plugins_with_limit"]

#: Seconds one plugin's import may take; generous next to a cold import of a framework.
DEFAULT_PLUGIN_TIMEOUT = 60.0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds > 0, got {text!r}; e.g. --plugin-timeout 60"
        )
    return value


def add_plugin_timeout_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--plugin-timeout SECONDS`` to a command's parser."""
    parser.add_argument(
        "--plugin-timeout",
        type=_seconds,
        default=DEFAULT_PLUGIN_TIMEOUT,
        metavar="SECONDS",
        help="how long each plugin's import may take before it is reported as not returning "
        f"(default {DEFAULT_PLUGIN_TIMEOUT:g})",
    )


def load_plugins_with_limit(seconds: float) -> None:
    """Load the process's registry, each plugin's import limited to ``seconds``."""
    import warnings

    from shardscale.core import PluginWarning, get_registry

    with warnings.catch_warnings():
        # Each failure is listed by the command itself: do not print it twice.
        warnings.simplefilter("ignore", PluginWarning)
        get_registry().load(import_timeout=seconds)
