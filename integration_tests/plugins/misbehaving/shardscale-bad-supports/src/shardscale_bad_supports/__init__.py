"""Test-only shardscale plugin (shardscale-bad-supports): high-priority stats kernels whose supports() raises."""

from __future__ import annotations

from shardscale.core import ForeachKernels, hookimpl


class RaisingKernels(ForeachKernels):
    name = "raising-supports"
    priority = 100

    def supports(self, device):
        raise RuntimeError("bad_supports: cannot tell")


@hookimpl
def shardscale_stats_kernels():
    return [RaisingKernels()]
