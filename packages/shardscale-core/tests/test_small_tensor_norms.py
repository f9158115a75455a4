"""The foreach kernels' read of many small tensors at once (one flat copy, one segmented sum).

Compared with torch.linalg.vector_norm per tensor in float64 in the same process; the
tolerance is the float32 rounding bound of a sum of n terms (n·u relative, u = 2^-24) plus
the final root's rounding, with n the tensor's size.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardscale.core import ForeachKernels
from shardscale.core._blas_kernels import BlasDotKernels
from shardscale.core._loop_kernels import LoopKernels


def _tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    # small (more than the dozen that takes the segmented read), empty and two large
    sizes = [5, 0, 1, 17, 3, 4096, 9, 0, 2, 6, 70_000, 8, 1, 33, 7, 12]
    return [(torch.randn(n, generator=gen) * 3).to(dtype) for n in sizes]


@pytest.mark.parametrize("kernels", [ForeachKernels(), BlasDotKernels(), LoopKernels()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
def test_many_small_tensors_read_together_give_each_norm(
    kernels: ForeachKernels, dtype: torch.dtype, p: float
) -> None:
    tensors = _tensors(dtype)
    got = kernels.tensor_norms(tensors, p)
    # 0 for an empty tensor, as the kernels promise (torch refuses its inf-norm).
    want = [float(torch.linalg.vector_norm(t.double(), p)) if t.numel() else 0.0 for t in tensors]
    acc = torch.float64 if dtype is torch.float64 else torch.float32
    assert got.dtype == acc and got.shape == (len(tensors),)
    u = torch.finfo(acc).eps / 2
    for t, g, w in zip(tensors, got.tolist(), want, strict=True):
        assert abs(g - w) <= (t.numel() + 2) * u * abs(w) * max(p if math.isfinite(p) else 1, 1)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("p", [2.0, math.inf, 1.0])
def test_a_non_finite_small_tensor_reads_non_finite_and_only_it(bad: float, p: float) -> None:
    tensors = _tensors(torch.float32)
    tensors[3][7] = bad
    got = ForeachKernels().tensor_norms(tensors, p)
    finite = torch.isfinite(got).tolist()
    assert finite == [i != 3 for i in range(len(tensors))]
    assert math.isnan(got[3]) if math.isnan(bad) else got[3] == math.inf


def test_the_loop_kernels_still_read_one_tensor_at_a_time() -> None:
    calls: list[int] = []

    class _Counting(LoopKernels):
        def _tensor_norms(self, tensors: object, norm_type: float, dtype: torch.dtype) -> object:
            calls.append(len(tensors))  # type: ignore[arg-type]
            return super()._tensor_norms(tensors, norm_type, dtype)  # type: ignore[arg-type]

    tensors = [t for t in _tensors(torch.float32) if t.numel()]
    _Counting().tensor_norms(tensors, 2.0)
    assert calls == [len(tensors)]  # every tensor through the per-tensor path
