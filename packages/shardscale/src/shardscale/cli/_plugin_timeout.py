"""``--plugin-timeout``: the time limit on each plugin's import for the commands that must finish.

``shardscale doctor`` and ``shardscale plugins`` report on plugins, broken ones
included, so a plugin whose import never returns must become a finding, not a
hang (see [Note: a time limit on import] in ``shardscale.core._plugin_loading``).
"""

from __future__ import annotations

import argparse

__all__ = [
    "DEFAULT_PLUGIN_TIMEOUT",
    "PLUGIN_TIMEOUT_RANGE",
    "add_plugin_timeout_option",
    "load_plugins_with_limit",
]

#: Seconds one plugin's import may take; generous next to a cold import of a framework.
DEFAULT_PLUGIN_TIMEOUT = 60.0
#: The range ``--plugin-timeout`` accepts: a tenth of a second to an hour. Past an hour a
#: report command is hung in all but name; far past it the wait overflows the thread join.
PLUGIN_TIMEOUT_RANGE = (0.1, 3600.0)


def add_plugin_timeout_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--plugin-timeout SECONDS`` to a command's parser."""
    from shardscale.cli._cmdline import bounded_float

    low, high = PLUGIN_TIMEOUT_RANGE
    parser.add_argument(
        "--plugin-timeout",
        type=bounded_float(low, high, unit="seconds", example="--plugin-timeout 60"),
        default=DEFAULT_PLUGIN_TIMEOUT,
        metavar="SECONDS",
        help="how long each plugin's import may take before it is reported as not returning "
        f"(default {DEFAULT_PLUGIN_TIMEOUT:g}; {low:g} to {high:g}); a plugin still importing "
        "after a few seconds is named on stderr",
    )


def load_plugins_with_limit(seconds: float) -> None:
    """Load the process's registry, each plugin's import limited to ``seconds``."""
    import warnings

    from shardscale.core import PluginWarning, get_registry

    with warnings.catch_warnings():
        # Each failure is listed by the command itself: do not print it twice.
        warnings.simplefilter("ignore", PluginWarning)
        get_registry().load(import_timeout=seconds)
