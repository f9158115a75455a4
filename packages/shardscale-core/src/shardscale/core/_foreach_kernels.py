"""The ``foreach`` statistics kernels: torch's multi-tensor ops, on every device."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch

__all__ = ["ForeachKernels"]

#: Tensors up to this many elements are read together when there are at least
#: ``_SEGMENT_MIN_COUNT`` of them: one copy into a flat buffer and one segmented reduction,
#: instead of a norm kernel and a 0-dim result tensor per tensor (a few µs each on the host,
#: which is what a step over thousands of small parameters costs; see docs/step-engine.md).
#: CPU only: there ``_foreach_norm`` is a loop of per-tensor kernels, while on a GPU it is
#: already one multi-tensor launch, which the copy and the segmented sum would only add to.
#: From about a dozen tensors the segmented read is the faster one on the host (16 tensors of
#: 64 elements: 45 -> 28 us; 8: 22 vs 28 us, one thread).
_SEGMENT_NUMEL = 1 << 12
_SEGMENT_MIN_COUNT = 12
_NUMEL = torch.Tensor.numel


class ForeachKernels:
    """Default kernels built on ``torch._foreach_*`` and torch's AMP unscale kernel.

    ``unscale_and_check_`` is one read and one write per gradient (the same
    kernel torch's GradScaler uses, so results are bit-identical).
    ``tensor_norms`` is one read.
    """

    name: ClassVar[str] = "foreach"
    priority: ClassVar[int] = 0
    #: Read many small tensors together (see ``_SEGMENT_NUMEL``); ``loop`` reads one at a time.
    segment_small: ClassVar[bool] = True

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
        # One dtype per list (StatsKernels' contract): no walk over the tensors to find it.
        acc = torch.float64 if tensors[0].dtype is torch.float64 else torch.float32
        numels = list(map(_NUMEL, tensors))
        small: Sequence[int] = (
            range(len(numels))  # the common case with tiny parameters: no walk to pick them
            if max(numels) <= _SEGMENT_NUMEL
            else [i for i, n in enumerate(numels) if n <= _SEGMENT_NUMEL]
        )
        if self.segment_small and device.type == "cpu" and len(small) >= _SEGMENT_MIN_COUNT:
            if len(small) == len(tensors):
                return _segment_norms(tensors, numels, norm_type, acc)
            large = [i for i, n in enumerate(numels) if n > _SEGMENT_NUMEL]
            out = torch.empty(len(tensors), dtype=acc, device=device)
            out[torch.tensor(small, device=device)] = _segment_norms(
                [tensors[i] for i in small], [numels[i] for i in small], norm_type, acc
            )
            big = self._norm_vector([tensors[i] for i in large], norm_type, acc)
            out[torch.tensor(large, device=device)] = big
            return out
        nonempty = [i for i, n in enumerate(numels) if n]
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


def _segment_norms(
    tensors: Sequence[torch.Tensor], numels: Sequence[int], norm_type: float, dtype: torch.dtype
) -> torch.Tensor:
    """Each small tensor's p-norm in ``dtype`` from one flat copy (0 for an empty tensor).

    inf and nan survive the sums and the max, so the overflow check still rides on this read.
    """
    # One C++ cat of the flattened tensors (torch's own helper, untyped).
    flat = torch._utils._flatten_dense_tensors(list(tensors))  # type: ignore[no-untyped-call]
    flat = flat.to(dtype).abs_()
    lengths = torch.tensor(list(numels), dtype=torch.long, device=flat.device)
    if math.isinf(norm_type):
        return torch.segment_reduce(flat, "max", lengths=lengths, unsafe=True, initial=0.0)
    if norm_type == 1.0:
        return torch.segment_reduce(flat, "sum", lengths=lengths, unsafe=True)
    if norm_type == 2.0:
        return torch.segment_reduce(flat.mul_(flat), "sum", lengths=lengths, unsafe=True).sqrt_()
    powered = flat.pow_(norm_type)
    return torch.segment_reduce(powered, "sum", lengths=lengths, unsafe=True).pow_(1.0 / norm_type)
