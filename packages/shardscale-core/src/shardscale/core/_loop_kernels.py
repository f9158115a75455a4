"""The ``loop`` statistics kernels: one tensor at a time, what ``foreach=False`` selects."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from shardscale.core._foreach_kernels import ForeachKernels

__all__ = ["LoopKernels"]


class LoopKernels(ForeachKernels):
    """Per-tensor kernels for devices or tensors where multi-tensor ops are unwanted.

    Never chosen automatically (negative priority): ``foreach=False`` or
    ``kernels="loop"`` asks for it, as torch's ``foreach=False`` asks for its
    per-tensor fallback.
    """

    name: ClassVar[str] = "loop"
    priority: ClassVar[int] = -10
    segment_small: ClassVar[bool] = False  # one tensor at a time, as foreach=False asks

    def unscale_and_check_(
        self, tensors: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
    ) -> None:
        """Multiply by ``inv_scale`` in place, one tensor per call, flagging inf/nan."""
        for t in tensors:
            torch._amp_foreach_non_finite_check_and_unscale_([t], found_inf, inv_scale)

    def _tensor_norms(
        self, tensors: Sequence[torch.Tensor], norm_type: float, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """One ``vector_norm`` per tensor; the combining is the foreach kernels' own."""
        return [torch.linalg.vector_norm(t, norm_type, dtype=dtype) for t in tensors]

    def mul_(self, tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
        """Multiply every tensor in place by the 0-dim ``coef``."""
        if tensors:
            coef = coef.to(tensors[0].device)
        for t in tensors:
            t.mul_(coef)
