"""get_total_norm / clip_grad_norm_ against torch.nn.utils, in one process.

Every tolerance comes from ``tolerances`` (integration_tests/): a bound on the
rounding error of the operation in its accumulation dtype, never a number one
machine printed. Low-precision gradients are compared with torch run on
float32 copies (torch reduces bf16/fp16 norms in the gradient dtype,
shardscale in float32 and rounds only the result to the gradients' dtype, which
is torch's result dtype) and with an exact float64 reference.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import clipped_grad_rtol, norm_rtol

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


def f32_bound(n: int) -> float:
    """Two float32 2-norms of the same n values differ by at most this (both within the bound)."""
    return 2 * norm_rtol(n, torch.float32, 2.0)


def numel(params: list[torch.nn.Parameter]) -> int:
    return sum(g.numel() for g in grads(params))


def exact_norm(params: list[torch.nn.Parameter], norm_type: float) -> torch.Tensor:
    """The p-norm computed in float64 from the gradients' exact values (an independent path)."""
    flat = torch.cat([g.detach().double().reshape(-1) for g in grads(params)])
    if math.isinf(norm_type):
        return flat.abs().max()
    # math.fsum is exactly rounded: the reference's own error is one float64 rounding.
    total = math.fsum(abs(v) ** norm_type for v in flat.tolist())
    return torch.tensor(total ** (1.0 / norm_type), dtype=torch.float64)


def out_u(dtype: torch.dtype) -> float:
    """Rounding the float32 result to a half-precision gradient dtype (torch's result dtype)."""
    return torch.finfo(dtype).eps / 2 if dtype in (torch.float16, torch.bfloat16) else 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("foreach", [None, True, False])
def test_total_norm_matches_torch(
    dtype: torch.dtype, norm_type: float, foreach: bool | None
) -> None:
    params = make_params(dtype)
    bound = norm_rtol(numel(params), dtype, norm_type)
    ours = get_total_norm(grads(params), norm_type, foreach=foreach)
    native = torch.nn.utils.get_total_norm(grads(params), norm_type)
    # torch's dtype: the gradients' (float16 for float16 gradients).
    assert type(ours) is torch.Tensor and ours.dim() == 0 and ours.dtype is native.dtype is dtype
    exact = exact_norm(params, norm_type)
    if float(exact) > torch.finfo(dtype).max:
        # The 0.5-norm of these is ~3e6: not a float16 number, inf in torch's and in ours.
        assert dtype is torch.float16 and math.isinf(float(ours)) and math.isinf(float(native))
        return
    assert rel(ours, exact) <= bound + out_u(dtype)
    ref = torch.nn.utils.get_total_norm(grads(fp32_copies(params)), norm_type)
    assert rel(ours, ref) <= 2 * bound + out_u(dtype)
    # torch in the native dtype agrees up to its own bound in that dtype (it accumulates there).
    native_bound = (numel(params) + 8) * torch.finfo(dtype).eps * max(1.0, 1 / norm_type)
    assert rel(ours, native.double()) <= bound + native_bound


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("max_norm", [0.1, 5.0, 1e6])
def test_clip_matches_torch(dtype: torch.dtype, norm_type: float, max_norm: float) -> None:
    params = make_params(dtype)
    ref_params = fp32_copies(params)
    exact = exact_norm(params, norm_type)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm, norm_type)
    norm = clip_grad_norm_(params, max_norm, norm_type)
    bound = norm_rtol(numel(params), dtype, norm_type)
    assert norm.dtype is dtype  # torch's result dtype; the clip used the float32 value
    if float(exact) <= torch.finfo(dtype).max:
        assert rel(norm, ref_norm) <= 2 * bound + out_u(dtype)
    tol = clipped_grad_rtol(numel(params), dtype, norm_type) * 2
    for p, q in zip(params, ref_params, strict=True):
        assert p.grad is not None and q.grad is not None
        assert p.grad.dtype is dtype
        # Clipped fp16 values can land among the subnormals, whose spacing is an absolute error.
        atol = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
        torch.testing.assert_close(p.grad.to(q.dtype), q.grad, rtol=tol, atol=atol)


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
    tol = 2 * clipped_grad_rtol(numel(params), torch.float32, 2.0)
    for g, r in zip(grads(params), grads(ref), strict=True):
        torch.testing.assert_close(g, r, rtol=tol, atol=0)


def test_single_tensor_and_generator_inputs() -> None:
    params = make_params(torch.float32)
    ref = torch.nn.utils.clip_grad_norm_(fp32_copies(params)[0], 1.0)
    assert rel(clip_grad_norm_(params[0], 1.0), ref) <= f32_bound(params[0].numel())
    assert rel(get_total_norm(params[1].grad), params[1].grad.norm()) <= f32_bound(13)  # type: ignore[arg-type]
    gen = (p for p in make_params(torch.float32))
    ref2 = torch.nn.utils.get_total_norm(grads(make_params(torch.float32)))
    assert rel(clip_grad_norm_(gen, 1e9), ref2) <= f32_bound(numel(make_params(torch.float32)))


def test_empty_inputs_return_zero_like_torch() -> None:
    assert get_total_norm([]).item() == torch.nn.utils.get_total_norm([]).item() == 0.0
    p = torch.nn.Parameter(torch.ones(3))  # no grad
    with pytest.warns(UserWarning, match="with no gradients"):  # as FSDP1's clip_grad_norm_
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
    assert rel(clip_grad_norm_(params, 1.0), ref) <= f32_bound(numel(params))
    assert params[2].grad is None


def test_mixed_dtypes_in_one_call() -> None:
    params = make_params(torch.float32) + make_params(torch.bfloat16, seed=1)
    ref = torch.nn.utils.get_total_norm(grads(fp32_copies(params)))
    assert rel(get_total_norm(grads(params)), ref) <= f32_bound(numel(params))


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
    assert rel(norm, torch.nn.utils.get_total_norm(before)) <= f32_bound(numel(params))
    for g, b in zip(grads(params), before, strict=True):
        assert torch.equal(g, b)


def test_sparse_gradients() -> None:
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2, 2, 7])).sum().backward()
    assert emb.weight.grad is not None and emb.weight.grad.is_sparse
    ref = emb.weight.grad.coalesce().to_dense().norm()
    assert rel(get_total_norm([emb.weight.grad]), ref) <= f32_bound(40)
    clip_grad_norm_(emb.parameters(), 0.5)
    clipped = emb.weight.grad.coalesce().to_dense().norm()
    assert rel(clipped, torch.tensor(0.5)) <= 2 * clipped_grad_rtol(40, torch.float32, 2.0)


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
    # The float64 reference's own error is negligible next to the float32 bound.
    bound = norm_rtol(sum(sizes), torch.float32, norm_type)
    assert rel(get_total_norm(tensors, norm_type), exact) <= bound + 1e-12


def test_no_warning_on_ordinary_use() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clip_grad_norm_(make_params(torch.float32), 1.0)
