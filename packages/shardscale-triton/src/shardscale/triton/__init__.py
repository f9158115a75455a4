"""shardscale.triton: the step's statistics and apply as Triton kernels, one launch each.

Installing ``shardscale-triton`` is all it takes: on a CUDA device where
``triton`` works, the step engine picks these kernels over ``foreach``
(``kernels="foreach"`` opts out). See ``docs/writing-a-kernels-plugin.md``.

This package is ``shardscale.triton``; inside it ``import triton`` always
means the real Triton package (absolute imports).
"""

from __future__ import annotations

from shardscale.triton._kernels import INTERPRET_ENV, TritonKernels

__all__ = ["TritonKernels", "INTERPRET_ENV"]
