"""Test-only shardscale plugin (shardscale-tie-b): an adapter and kernels with the same priority as its twin's."""

from __future__ import annotations

from shardscale.core import ForeachKernels, PlainTensorAdapter, hookimpl


class TieAdapter(PlainTensorAdapter):
    """Claims only parameters tagged ``_tie_test``, with priority 40, as its twin does."""

    name = "tie-b"
    priority = 40

    def claims(self, param):
        return bool(getattr(param, "_tie_test", False))


class TieKernels(ForeachKernels):
    """Supports only the meta device, with priority 5, as its twin does."""

    name = "tie-b"
    priority = 5

    def supports(self, device):
        return device.type == "meta"


@hookimpl
def shardscale_grad_adapters():
    return [TieAdapter()]


@hookimpl
def shardscale_stats_kernels():
    return [TieKernels()]
