"""The statistics read touches each gradient once, for every dtype, with the flag riding on it.

Counted with the benchmark's ``GradBytesCounter`` (aten ops that really ran),
in one process: ``get_total_norm`` is the engine's read alone (``Apply.NOTHING``).
"""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import norm_rtol

from shardscale.cli.bench import GradBytesCounter
from shardscale.clip import get_total_norm

SIZES = (7, 40_000, 300)  # one tensor large enough for blas-dot's dot product


def _grads(dtype: torch.dtype, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(dtype) for n in SIZES]


def _exact(grads: list[torch.Tensor]) -> float:
    values = [abs(v) for g in grads for v in g.double().reshape(-1).tolist()]
    top = max(values)
    return top * math.fsum((v / top) ** 2 for v in values) ** 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("kernels", ["blas-dot", "foreach"])
def test_one_read_of_each_gradient_and_nothing_written(dtype: torch.dtype, kernels: str) -> None:
    grads = _grads(dtype)
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    with GradBytesCounter(grads) as counter:
        norm = get_total_norm(grads, 2.0, backend="local", kernels=kernels)
    assert (counter.read, counter.written) == (nbytes, 0), counter.by_op
    n = sum(g.numel() for g in grads)
    assert abs(float(norm) - _exact(grads)) <= norm_rtol(n, dtype, 2.0) * _exact(grads)


def test_float64_norm_beyond_the_squares_range_is_read_again_and_exact() -> None:
    # Squares of 1e160 overflow float64: the plain read says inf, the normalised one is exact.
    grads = _grads(torch.float64, scale=1e160)
    norm = get_total_norm(grads, 2.0, backend="local")
    exact = _exact(grads)
    n = sum(g.numel() for g in grads)
    assert (
        math.isfinite(float(norm))
        and abs(float(norm) - exact) <= norm_rtol(n, torch.float64, 2.0) * exact
    )


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_nonfinite_element_in_any_dtype_makes_the_norm_nonfinite(
    dtype: torch.dtype, bad: float
) -> None:
    grads = _grads(dtype)
    grads[1][123] = bad  # in the tensor the dot product reads
    norm = float(get_total_norm(grads, 2.0, backend="local"))
    assert math.isnan(norm) if math.isnan(bad) else math.isinf(norm)
