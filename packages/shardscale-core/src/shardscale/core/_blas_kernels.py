"""The ``blas-dot`` statistics kernels: the 2-norm read through BLAS dot products on the CPU.

[Note: why a dot product]
On the CPU, ``torch.dot(g, g)`` reads a float32/float64 gradient once through
the BLAS library and is measurably faster than ``torch._foreach_norm`` for the
same Σ g² (about 18 % on one thread for 16 MiB tensors on this project's CI
machine; ``nox -s bench`` shows the effect on the whole post-processing).
A non-finite element still makes the result non-finite, so the overflow check
keeps riding on the same read. Only tensors large enough for the read to
outweigh a call take the dot product (``DOT_MIN_NUMEL``): for many small
FSDP shards one ``_foreach_norm`` call over all of them costs less host time
than a Python call per tensor, and the memory read is the same. The square
roots are taken once, on the vector of sums. Everything else (other norms,
half-precision gradients, the unscale and the multiply) is the ``foreach``
kernels' work. GPUs keep ``foreach``: one launch for the whole list beats one
per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from shardscale.core._foreach_kernels import ForeachKernels

__all__ = ["DOT_MIN_NUMEL", "BlasDotKernels"]

_DOT_DTYPES = (torch.float32, torch.float64)

#: Elements from which a tensor's 2-norm is a BLAS dot product; smaller ones share one
#: ``_foreach_norm`` call. At 2**15 float32 elements (128 KiB) the read takes tens of µs,
#: several times the few µs of one more Python call.
DOT_MIN_NUMEL = 2**15


class BlasDotKernels(ForeachKernels):
    """``foreach`` kernels whose float32/float64 2-norm on the CPU is a sum of dot products.

    Chosen automatically on the CPU (priority above ``foreach``); ask for
    ``kernels="foreach"`` to opt out.
    """

    name: ClassVar[str] = "blas-dot"
    priority: ClassVar[int] = 10

    def supports(self, device: torch.device) -> bool:
        """CPU only."""
        return device.type == "cpu"

    def _norm_vector(
        self, tensors: Sequence[torch.Tensor], norm_type: float, dtype: torch.dtype
    ) -> torch.Tensor:
        """‖g‖₂ as the root of a BLAS dot product for large float32/float64 tensors, else foreach."""
        if norm_type != 2.0 or any(t.dtype not in _DOT_DTYPES for t in tensors):
            return super()._norm_vector(tensors, norm_type, dtype)
        large = [i for i, t in enumerate(tensors) if t.numel() >= DOT_MIN_NUMEL]
        if not large:
            return super()._norm_vector(tensors, norm_type, dtype)
        sums = torch.stack([_dot_self(tensors[i]) for i in large]).to(dtype)
        if len(large) == len(tensors):
            return sums.sqrt_()
        out = torch.empty(len(tensors), dtype=dtype, device=tensors[0].device)
        small = [i for i, t in enumerate(tensors) if t.numel() < DOT_MIN_NUMEL]
        out[small] = super()._norm_vector([tensors[i] for i in small], norm_type, dtype)
        out[large] = sums.sqrt_()
        return out


def _dot_self(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)  # a copy only for a non-contiguous tensor, as torch.dot needs 1-D
    return torch.dot(flat, flat)
