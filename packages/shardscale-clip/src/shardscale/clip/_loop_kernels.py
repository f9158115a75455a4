"""The ``loop`` statistics kernels: one tensor at a time, what ``foreach=False`` selects."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch

__all__ = ["LoopKernels"]


class LoopKernels:
    """Per-tensor kernels for devices or tensors where multi-tensor ops are unwanted.

    Never chosen automatically (negative priority): ``foreach=False`` or
    ``kernels="loop"`` asks for it, as torch's ``foreach=False`` asks for its
    per-tensor fallback.
    """

    name: ClassVar[str] = "loop"
    priority: ClassVar[int] = -10

    def supports(self, device: torch.device) -> bool:
        """Plain tensor ops run on every device."""
        del device
        return True

    def unscale_and_check_(
        self, tensors: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
    ) -> None:
        """Multiply by ``inv_scale`` in place, one tensor per call, flagging inf/nan."""
        for t in tensors:
            torch._amp_foreach_non_finite_check_and_unscale_([t], found_inf, inv_scale)

    def partial_norm(self, tensors: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        """Σ|x|^p (finite p) or max|x| (inf) over every element, as float32."""
        if not tensors:
            return torch.zeros((), dtype=torch.float32)
        # At least float32 accumulation: fp16 sums overflow long before fp32 ones.
        acc = torch.float64 if tensors[0].dtype is torch.float64 else torch.float32
        norms = torch.stack([torch.linalg.vector_norm(t, norm_type, dtype=acc) for t in tensors])
        if math.isinf(norm_type):
            total = norms.max()
        elif norm_type == 1.0:
            total = norms.sum()
        else:
            total = norms.pow(norm_type).sum()
        return total.to(torch.float32)

    def mul_(self, tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
        """Multiply every tensor in place by the 0-dim ``coef``."""
        if tensors:
            coef = coef.to(tensors[0].device)
        for t in tensors:
            t.mul_(coef)
