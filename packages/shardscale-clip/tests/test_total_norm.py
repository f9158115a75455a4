"""get_total_norm / clip_grad_norm_ against torch.nn.utils, in one process.

Low-precision gradients are compared with torch run on float32 copies: torch
reduces bf16/fp16 norms in the gradient dtype, shardscale always in float32, so
the float32 reference is the exact value both aim at.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardscale.clip import clip_grad_norm_, get_total_norm

NORM_TYPES = [0.5, 1.0, 2.0, 3.0, math.inf]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SHAPES = [(7, 5), (13,), (3, 4, 2), (1,), (64, 33)]


def make_params(dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in SHAPES:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
        p.grad = (torch.randn(shape, generator=gen) * scale).to(dtype)
        params.append(p)
    return params


def fp32_copies(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Copies in float32 (float64 stays float64): the exact reference for every dtype."""
    out = []
    for p in params:
        dtype = torch.float64 if p.dtype is torch.float64 else torch.float32
        q = torch.nn.Parameter(p.detach().to(dtype).clone())
        assert p.grad is not None
        q.grad = p.grad.detach().to(dtype).clone()
        out.append(q)
    return out


def grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.double() - b.double()).abs() / b.double().abs().clamp(min=1e-30)).item())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("foreach", [None, True, False])
def test_total_norm_matches_torch(
    dtype: torch.dtype, norm_type: float, foreach: bool | None
) -> None:
    params = make_params(dtype)
    ref = torch.nn.utils.get_total_norm(grads(fp32_copies(params)), norm_type)
    ours = get_total_norm(grads(params), norm_type, foreach=foreach)
    assert type(ours) is torch.Tensor and ours.dim() == 0 and ours.dtype is torch.float32
    assert rel(ours, ref) < 1e-5
    # And torch in the native dtype agrees up to that dtype's own rounding.
    native = torch.nn.utils.get_total_norm(grads(params), norm_type)
    if torch.isfinite(native):
        assert rel(ours, native.float()) < 4 * torch.finfo(dtype).eps
    else:
        # torch's fp16 accumulation overflowed (the 0.5-norm of these is ~3e6); ours did not.
        assert dtype is torch.float16 and torch.isfinite(ours)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("max_norm", [0.1, 5.0, 1e6])
def test_clip_matches_torch(dtype: torch.dtype, norm_type: float, max_norm: float) -> None:
    params = make_params(dtype)
    ref_params = fp32_copies(params)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm, norm_type)
    norm = clip_grad_norm_(params, max_norm, norm_type)
    assert rel(norm, ref_norm) < 1e-5
    # One rounding of the gradient dtype, or of the float32 coefficient, apart.
    tol = 2 * max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)
    for p, q in zip(params, ref_params, strict=True):
        assert p.grad is not None and q.grad is not None
        assert p.grad.dtype is dtype
        torch.testing.assert_close(p.grad.to(q.dtype), q.grad, rtol=tol, atol=1e-7)


def test_fp32_clip_is_torch_to_the_last_bit_when_not_clipping() -> None:
    params = make_params(torch.float32)
    before = [g.clone() for g in grads(params)]
    clip_grad_norm_(params, 1e9)
    for g, b in zip(grads(params), before, strict=True):
        assert torch.equal(g, b)


def test_fp32_clipped_gradients_match_torch_within_rounding() -> None:
    params = make_params(torch.float32, scale=3.0)
    ref = fp32_copies(params)
    torch.nn.utils.clip_grad_norm_(ref, 0.5)
    clip_grad_norm_(params, 0.5)
    for g, r in zip(grads(params), grads(ref), strict=True):
        torch.testing.assert_close(g, r, rtol=2e-7, atol=0)


def test_single_tensor_and_generator_inputs() -> None:
    params = make_params(torch.float32)
    ref = torch.nn.utils.clip_grad_norm_(fp32_copies(params)[0], 1.0)
    assert rel(clip_grad_norm_(params[0], 1.0), ref) < 1e-6
    assert rel(get_total_norm(params[1].grad), params[1].grad.norm()) < 1e-6  # type: ignore[arg-type]
    gen = (p for p in make_params(torch.float32))
    ref2 = torch.nn.utils.get_total_norm(grads(make_params(torch.float32)))
    assert rel(clip_grad_norm_(gen, 1e9), ref2) < 1e-6


def test_empty_inputs_return_zero_like_torch() -> None:
    assert get_total_norm([]).item() == torch.nn.utils.get_total_norm([]).item() == 0.0
    p = torch.nn.Parameter(torch.ones(3))  # no grad
    assert clip_grad_norm_([p], 1.0).item() == 0.0
    assert p.grad is None
    with pytest.warns(UserWarning, match="empty generator"):
        clip_grad_norm_((q for q in []), 1.0)


def test_parameters_without_grad_are_skipped() -> None:
    params = make_params(torch.float32)
    params[2].grad = None
    ref = torch.nn.utils.clip_grad_norm_(
        fp32_copies([p for p in params if p.grad is not None]), 1.0
    )
    assert rel(clip_grad_norm_(params, 1.0), ref) < 1e-6
    assert params[2].grad is None


def test_mixed_dtypes_in_one_call() -> None:
    params = make_params(torch.float32) + make_params(torch.bfloat16, seed=1)
    ref = torch.nn.utils.get_total_norm(grads(fp32_copies(params)))
    assert rel(get_total_norm(grads(params)), ref) < 1e-5


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_nonfinite_gradients(bad: float, norm_type: float) -> None:
    params = make_params(torch.float32)
    assert params[1].grad is not None
    params[1].grad[3] = bad
    ref = torch.nn.utils.get_total_norm(grads(fp32_copies(params)), norm_type)
    ours = get_total_norm(grads(params), norm_type)
    assert not torch.isfinite(ours)
    assert torch.isnan(ours) == torch.isnan(ref)
    before = [g.clone() for g in grads(params)]
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(params, 1.0, norm_type, error_if_nonfinite=True)
    for g, b in zip(grads(params), before, strict=True):
        assert torch.equal(g.nan_to_num(), b.nan_to_num())  # nothing was multiplied


def test_inf_max_norm_only_measures() -> None:
    params = make_params(torch.float32, scale=100.0)
    before = [g.clone() for g in grads(params)]
    norm = clip_grad_norm_(params, math.inf)
    assert rel(norm, torch.nn.utils.get_total_norm(before)) < 1e-6
    for g, b in zip(grads(params), before, strict=True):
        assert torch.equal(g, b)


def test_sparse_gradients() -> None:
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2, 2, 7])).sum().backward()
    assert emb.weight.grad is not None and emb.weight.grad.is_sparse
    ref = emb.weight.grad.coalesce().to_dense().norm()
    assert rel(get_total_norm([emb.weight.grad]), ref) < 1e-6
    clip_grad_norm_(emb.parameters(), 0.5)
    assert rel(emb.weight.grad.coalesce().to_dense().norm(), torch.tensor(0.5)) < 1e-5


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=6),
    norm_type=st.sampled_from([0.7, 1.0, 1.5, 2.0, 4.0, math.inf]),
    magnitude=st.floats(1e-6, 1e3),
    seed=st.integers(0, 2**16),
)
def test_norm_property_against_float64(
    sizes: list[int], norm_type: float, magnitude: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(n, generator=gen) * magnitude for n in sizes]
    exact = torch.linalg.vector_norm(torch.cat([t.double() for t in tensors]), norm_type)
    assert rel(get_total_norm(tensors, norm_type), exact) < 1e-5


def test_no_warning_on_ordinary_use() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clip_grad_norm_(make_params(torch.float32), 1.0)
