"""Test-only shardscale plugin (shardscale-bad-observer): a shardscale_on_step observer that raises."""

from __future__ import annotations

from shardscale.core import hookimpl

CALLS = []


@hookimpl
def shardscale_on_step(record):
    CALLS.append(record.step)
    raise RuntimeError("bad_observer: cannot log")
