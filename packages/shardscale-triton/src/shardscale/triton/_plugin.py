"""shardscale-triton's plugin: the ``triton`` stats kernels.

Importing this module does not import ``triton`` (it takes seconds): the
kernels import it on first use, so listing plugins stays cheap.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardscale.core import hookimpl
from shardscale.triton._kernels import TritonKernels

__all__ = ["shardscale_stats_kernels"]


@hookimpl
def shardscale_stats_kernels() -> Sequence[object]:
    """The Triton kernels (chosen on CUDA devices where they are usable)."""
    return [_KERNELS]


_KERNELS = TritonKernels()
