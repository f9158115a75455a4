"""Test-only shardscale plugin (shardscale-bad-hook-raises): its backends hook raises; its middleware hook works."""

from __future__ import annotations

from shardscale.core import MiddlewareBase, hookimpl


class Passthrough(MiddlewareBase):
    """A working middleware: the plugin's other hook still counts."""

    name = "passthrough"


@hookimpl
def shardscale_collective_backends():
    raise RuntimeError("bad_hook_raises: the backends hook is broken")


@hookimpl
def shardscale_middlewares():
    return [Passthrough]
