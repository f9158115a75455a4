"""Test-only shardscale plugin (shardscale-rival-c10d): a second backend named c10d."""

from __future__ import annotations

from shardscale.core import LocalBackend, hookimpl


class RivalC10d(LocalBackend):
    name = "c10d"


@hookimpl
def shardscale_collective_backends():
    return [RivalC10d]
