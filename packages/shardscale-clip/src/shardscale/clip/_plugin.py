"""shardscale-clip's plugin: the per-tensor ``loop`` stats kernels (``foreach=False``)."""

from __future__ import annotations

from collections.abc import Sequence

from shardscale.clip._loop_kernels import LoopKernels
from shardscale.core import hookimpl

__all__ = ["shardscale_stats_kernels"]


@hookimpl
def shardscale_stats_kernels() -> Sequence[object]:
    """The ``loop`` kernels (never chosen automatically)."""
    return [LoopKernels()]
