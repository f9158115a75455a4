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
    ``tensor_norms`` is one read.
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

    def tensor_norms(self, tensors: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        """Each tensor's p-norm (max|x| for inf), a 1-D tensor on the tensors' device.

        Accumulated in float32 (float64 for float64 tensors); empty tensors
        (uneven FSDP shards) give 0. A non-finite element makes that tensor's
        norm non-finite: the overflow check rides on this read.
        """
        if not tensors:
            return torch.zeros(0, dtype=torch.float32)
        device = tensors[0].device
        acc = torch.float64 if any(t.dtype is torch.float64 for t in tensors) else torch.float32
        nonempty = [i for i, t in enumerate(tensors) if t.numel()]
        if len(nonempty) == len(tensors):
            return self._norm_vector(tensors, norm_type, acc)
        out = torch.zeros(len(tensors), dtype=acc, device=device)
        if nonempty:
            out[nonempty] = self._norm_vector([tensors[i] for i in nonempty], norm_type, acc)
        return out

    def _norm_vector(
        self, tensors: Sequence[torch.Tensor], norm_type: float, dtype: torch.dtype
    ) -> torch.Tensor:
        """Each (non-empty) tensor's p-norm as one 1-D ``dtype`` tensor."""
        return torch.stack(self._tensor_norms(tensors, norm_type, dtype)).to(dtype)

    def _tensor_norms(
        self, tensors: Sequence[torch.Tensor], norm_type: float, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """Each (non-empty) tensor's p-norm in ``dtype``; subclasses change only how."""
        if math.isinf(norm_type) and tensors[0].device.type == "cpu":
            # torch's CPU inf-norm is ~30x slower than a min/max scan; nan survives aminmax.
            out = []
            for t in tensors:
                low, high = torch.aminmax(t.reshape(-1))
                out.append(torch.maximum(high.abs(), low.abs()).to(dtype))
            return out
        return list(torch._foreach_norm(list(tensors), norm_type, dtype=dtype))

    def mul_(self, tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
        """Multiply every tensor in place by the 0-dim ``coef``."""
        if tensors:
            torch._foreach_mul_(list(tensors), coef.to(tensors[0].device))
