"""Norms that cannot overflow, float64 norms, and float16 norms returned in torch's dtype.

Regression tests: with p >= 6 at scale 2^16, Σ|s·g|^p overflowed float32, so
finite steps were skipped and the scale collapsed while torch's ``unscale_`` +
``clip_grad_norm_`` stepped normally; float64 gradients got a float32 norm
(inf above ~1.8e19). Tolerances come from ``tolerances`` (integration_tests/).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from tolerances import norm_rtol

from shardscale.clip import clip_grad_norm_, get_total_norm, unscale_and_clip_
from shardscale.core import ShardedGradScaler


def _grads(dtype: torch.dtype, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(n, generator=gen) * scale).to(dtype) for n in (7, 300, 41)]


def _exact(grads: list[torch.Tensor], p: float, divide: float = 1.0) -> float:
    # Every value is exact in float64; math.fsum of powers scaled by the max is exactly rounded.
    values = [abs(v) / divide for g in grads for v in g.double().reshape(-1).tolist()]
    top = max(values)
    return top * math.fsum((v / top) ** p for v in values) ** (1 / p)


@pytest.mark.parametrize("p", [8.0, 16.0, 32.0])
@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**24])
def test_large_p_at_a_large_scale_steps_with_the_true_norm(p: float, init_scale: float) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ref.load_state_dict(model.state_dict())
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    ours = ShardedGradScaler("cpu", backend="local", init_scale=init_scale)
    theirs = torch.amp.GradScaler("cpu", init_scale=init_scale)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ours.scale(model(x).pow(2).sum()).backward()
    theirs.scale(ref(x).pow(2).sum()).backward()
    scaled = [q.grad.clone() for q in model.parameters()]  # type: ignore[union-attr]
    norm = unscale_and_clip_(ours, opt, max_norm=1e9, norm_type=p)
    theirs.unscale_(ref_opt)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=p)
    exact = _exact(scaled, p, divide=init_scale)
    n = sum(g.numel() for g in scaled)
    assert math.isfinite(float(norm)), "a finite step was taken for an overflow"
    assert abs(float(norm) - exact) <= norm_rtol(n, torch.float32, p) * exact
    assert abs(float(norm) - float(ref_norm)) <= 2 * norm_rtol(n, torch.float32, p) * exact
    ours.step(opt)
    theirs.step(ref_opt)
    ours.update()
    theirs.update()
    assert ours.get_scale() == theirs.get_scale() == init_scale  # no spurious backoff


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, math.inf])
def test_float64_gradients_get_a_float64_norm_like_torch(p: float) -> None:
    grads = _grads(torch.float64, scale=1e20)  # a norm above float32's max square root
    ours = get_total_norm(grads, p)
    ref = torch.nn.utils.get_total_norm(grads, p)
    assert ours.dtype is ref.dtype is torch.float64
    assert math.isfinite(float(ours))
    n = sum(g.numel() for g in grads)
    exact = _exact(grads, p) if not math.isinf(p) else max(float(g.abs().max()) for g in grads)
    assert abs(float(ours) - exact) <= norm_rtol(n, torch.float64, p) * exact
    assert abs(float(ours) - float(ref)) <= 2 * norm_rtol(n, torch.float64, p) * exact


def test_float16_gradients_get_torch_dtype_and_are_clipped_by_the_true_norm() -> None:
    # torch returns the gradients' dtype, so a norm above 65504 reads inf in both; torch then
    # clips by that inf (every gradient becomes 0), ours by the float32 value it computed
    # first (docs/migration.md lists the difference).
    grads = [torch.full((10_000,), 60_000.0, dtype=torch.float16)]
    ref = torch.nn.utils.get_total_norm(grads)
    ours = get_total_norm(grads)
    assert ref.dtype is ours.dtype is torch.float16
    assert math.isinf(float(ref)) and math.isinf(float(ours))
    theirs_p = torch.nn.Parameter(torch.zeros(10_000, dtype=torch.float16))
    ours_p = torch.nn.Parameter(torch.zeros(10_000, dtype=torch.float16))
    theirs_p.grad, ours_p.grad = grads[0].clone(), grads[0].clone()
    torch.nn.utils.clip_grad_norm_([theirs_p], 1.0)
    clip_grad_norm_([ours_p], 1.0)
    assert theirs_p.grad is not None and float(theirs_p.grad.abs().max()) == 0.0
    assert ours_p.grad is not None
    # The clipped norm is 1 up to the float32 norm's bound and one float16 rounding per element.
    bound = norm_rtol(10_000, torch.float16, 2.0) + torch.finfo(torch.float16).eps
    clipped = float(torch.linalg.vector_norm(ours_p.grad.double()))
    assert clipped == pytest.approx(1.0, rel=bound)


def test_a_rank_without_gradients_warns_like_fsdp1() -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    # FSDP1's words, which torch's own FSDP1 test matches.
    expected = "on rank 0 with no gradients -- returning the total norm in the default dtype"
    with pytest.warns(UserWarning, match=f"{expected} torch.float32"):
        norm = clip_grad_norm_(params, 1.0)
    assert float(norm) == 0.0 and norm.dtype is torch.float32
    params[0].grad = torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clip_grad_norm_(params, 1.0)
