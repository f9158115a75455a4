"""The ``foreach`` statistics kernels: torch's multi-tensor ops, on every device."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch

__all__ = ["ForeachKernels"]


class ForeachKernels:
    """Default kernels built on ``torch._foreach_*`` and torch's AMP unscale kernel.

    ``unscale_and_check_`` is one read and one write per gradient (the same
    kernel torch's GradScaler uses, so results are bit-identical).
    ``partial_norm`` is one read.
    """

    name: ClassVar[str] = "foreach"
    priority: ClassVar[int] = 0

    def supports(self, device: torch.device) -> bool:
        """Foreach ops run on every device torch supports."""
        del device
        return True

    def unscale_and_check_(
        self, tensors: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
    ) -> None:
        """Multiply by ``inv_scale`` in place and flag inf/nan in ``found_inf``."""
        if tensors:
            torch._amp_foreach_non_finite_check_and_unscale_(list(tensors), found_inf, inv_scale)

    def partial_norm(self, tensors: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        """Σ|x|^p (finite p) or max|x| (inf) over every element, as float32."""
        if not tensors:
            return torch.zeros((), dtype=torch.float32)
        device = tensors[0].device
        # Empty local shards (uneven FSDP sharding) add nothing, and torch's inf-norm rejects them.
        tensors = [t for t in tensors if t.numel()]
        if not tensors:
            return torch.zeros((), dtype=torch.float32, device=device)
        # Reduce in float32 at least: fp16 sums overflow long before fp32 ones (float64 stays).
        acc = torch.float64 if tensors[0].dtype is torch.float64 else torch.float32
        stacked = torch.stack(self._tensor_norms(tensors, norm_type, acc))
        if math.isinf(norm_type):
            total = stacked.max()
        elif norm_type == 1.0:
            total = stacked.sum()
        else:
            # Σ_t ||t||_p^p: each norm is raised back to p so partials add across tensors and ranks.
            total = stacked.pow(norm_type).sum()
        return total.to(device=device, dtype=torch.float32)

    def _tensor_norms(
        self, tensors: Sequence[torch.Tensor], norm_type: float, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """Each (non-empty) tensor's p-norm in ``dtype``; subclasses change only how."""
        return list(torch._foreach_norm(list(tensors), norm_type, dtype=dtype))

    def mul_(self, tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
        """Multiply every tensor in place by the 0-dim ``coef``."""
        if tensors:
            torch._foreach_mul_(list(tensors), coef.to(tensors[0].device))
