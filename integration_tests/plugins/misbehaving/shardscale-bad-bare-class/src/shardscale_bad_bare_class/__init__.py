"""Test-only shardscale plugin (shardscale-bad-bare-class): its backends hook returns a class instead of a list of classes."""

from __future__ import annotations

from shardscale.core import LocalBackend, hookimpl


class BareBackend(LocalBackend):
    name = "bare"


@hookimpl
def shardscale_collective_backends():
    return BareBackend  # should be [BareBackend]
