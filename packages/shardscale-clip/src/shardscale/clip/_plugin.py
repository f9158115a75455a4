"""shardscale-clip's plugin: the ``loop`` (``foreach=False``) and CPU ``blas-dot`` stats kernels."""

from __future__ import annotations

from collections.abc import Sequence

from shardscale.clip._blas_kernels import BlasDotKernels
from shardscale.clip._loop_kernels import LoopKernels
from shardscale.core import hookimpl

__all__ = ["shardscale_stats_kernels"]


@hookimpl
def shardscale_stats_kernels() -> Sequence[object]:
    """``loop`` (never chosen automatically) and ``blas-dot`` (chosen on the CPU)."""
    return [LoopKernels(), BlasDotKernels()]
