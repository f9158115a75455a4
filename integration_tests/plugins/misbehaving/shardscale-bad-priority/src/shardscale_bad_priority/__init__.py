"""Test-only shardscale plugin (shardscale-bad-priority): a grad adapter whose priority is the string 'high'."""

from __future__ import annotations

from shardscale.core import PlainTensorAdapter, hookimpl


class HighAdapter(PlainTensorAdapter):
    name = "high"
    priority = "high"


@hookimpl
def shardscale_grad_adapters():
    return [HighAdapter()]
