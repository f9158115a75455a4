"""Bad input raises an error naming the problem and the fix, and changes nothing."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from tolerances import norm_rtol

from shardscale.clip import clip_grad_norm_, get_total_norm, unscale_and_clip_
from shardscale.core import PluginNotFoundError, ShardedGradScaler


def setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, ShardedGradScaler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", backend="local", init_scale=64.0)
    scaler.scale(model(torch.randn(4, 6)).pow(2).sum()).backward()
    return model, opt, scaler


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [q.grad.clone() for q in model.parameters()]  # type: ignore[union-attr]


def assert_unchanged(model: torch.nn.Module, before: list[torch.Tensor]) -> None:
    for q, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(q.grad, b)  # type: ignore[arg-type]


BAD_MAX_NORM: list[tuple[Any, type[Exception], str]] = [
    (0.0, ValueError, "max_norm must be a positive number"),
    (-1.0, ValueError, "max_norm must be a positive number"),
    (math.nan, ValueError, "max_norm must be a positive number"),
    (True, TypeError, "bool"),
    ("big", TypeError, "max_norm must be a number"),
    (None, TypeError, "max_norm must be a number"),
    (torch.ones(2), ValueError, "one-element tensor"),
]
BAD_NORM_TYPE: list[tuple[Any, type[Exception], str]] = [
    (0, ValueError, "norm_type must be > 0"),
    (-2.0, ValueError, "norm_type must be > 0"),
    (-math.inf, ValueError, "norm_type must be > 0"),
    (math.nan, ValueError, "norm_type must be > 0"),
    ("fro", TypeError, "norm_type must be a number"),
]


@pytest.mark.parametrize(("max_norm", "exc", "msg"), BAD_MAX_NORM)
def test_bad_max_norm(max_norm: Any, exc: type[Exception], msg: str) -> None:
    model, opt, scaler = setup()
    before = snapshot(model)
    with pytest.raises(exc, match=msg):
        unscale_and_clip_(scaler, opt, max_norm)
    with pytest.raises(exc, match=msg):
        clip_grad_norm_(model.parameters(), max_norm)
    assert_unchanged(model, before)
    # The scaler was not touched: the iteration can still go on normally.
    unscale_and_clip_(scaler, opt, 1.0)
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize(("norm_type", "exc", "msg"), BAD_NORM_TYPE)
def test_bad_norm_type(norm_type: Any, exc: type[Exception], msg: str) -> None:
    model, opt, scaler = setup()
    before = snapshot(model)
    with pytest.raises(exc, match=msg):
        unscale_and_clip_(scaler, opt, 1.0, norm_type)
    with pytest.raises(exc, match=msg):
        clip_grad_norm_(model.parameters(), 1.0, norm_type)
    with pytest.raises(exc, match=msg):
        get_total_norm([q.grad for q in model.parameters()], norm_type)  # type: ignore[misc]
    assert_unchanged(model, before)
    unscale_and_clip_(scaler, opt, 1.0)


@pytest.mark.parametrize("good", [1, 2.0, "inf", math.inf, torch.tensor(2.0)])
def test_norm_types_torch_accepts(good: Any) -> None:
    model, _, _ = setup()
    grads = [q.grad for q in model.parameters()]
    ref = torch.nn.utils.get_total_norm(grads, float(good))  # type: ignore[arg-type]
    ours = get_total_norm(grads, good)  # type: ignore[arg-type]
    n = sum(g.numel() for g in grads if g is not None)
    assert abs(float(ours) - float(ref)) <= 2 * norm_rtol(n, torch.float32, float(good)) * float(
        ref
    )


def test_second_call_in_one_iteration_is_refused() -> None:
    model, opt, scaler = setup()
    unscale_and_clip_(scaler, opt, 1.0)
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="once per optimizer"):
        unscale_and_clip_(scaler, opt, 1.0)
    assert_unchanged(model, before)


def test_after_unscale_or_step_is_refused() -> None:
    model, opt, scaler = setup()
    scaler.unscale_(opt)
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="already unscaled"):
        unscale_and_clip_(scaler, opt, 1.0)
    assert_unchanged(model, before)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="already stepped"):
        unscale_and_clip_(scaler, opt, 1.0)


def test_before_scale_uses_init_scale() -> None:
    """A scaler that never scaled a loss (a pipeline stage) unscales by its init_scale."""
    model = torch.nn.Linear(3, 1)
    (model(torch.randn(2, 3)).sum() * 8.0).backward()  # gradients that carry a scale of 8
    expected = [p.grad.clone() / 8.0 for p in model.parameters()]  # type: ignore[union-attr]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=8.0, backend="local")
    unscale_and_clip_(scaler, opt, math.inf, fuse_optimizer=False)  # multiplied now, readable
    for p, e in zip(model.parameters(), expected, strict=True):
        assert torch.equal(p.grad, e)  # dividing by a power of two is exact


def test_wrong_objects_name_the_fix() -> None:
    model, opt, _ = setup()
    with pytest.raises(TypeError, match="ShardedGradScaler"):
        unscale_and_clip_(torch.amp.GradScaler("cpu"), opt, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"torch.optim.Optimizer"):
        unscale_and_clip_(ShardedGradScaler("cpu"), model.parameters(), 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected parameters to be tensors"):
        clip_grad_norm_([1.0, 2.0], 1.0)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="foreach must be"):
        clip_grad_norm_(model.parameters(), 1.0, foreach="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"distinct_dims=\('pp',\)"):
        clip_grad_norm_(model.parameters(), 1.0, distinct_dims="pp")


def test_unknown_backend_or_kernels_are_named() -> None:
    model, _, _ = setup()
    before = snapshot(model)
    with pytest.raises(PluginNotFoundError, match="misspelled or not installed"):
        clip_grad_norm_(model.parameters(), 1.0, backend="nope")
    with pytest.raises(PluginNotFoundError, match="no kernels named 'nope'"):
        clip_grad_norm_(model.parameters(), 1.0, kernels="nope")
    assert_unchanged(model, before)


def test_integer_gradients_are_refused() -> None:
    with pytest.raises(TypeError, match="real floating point"):
        get_total_norm([torch.ones(3, dtype=torch.int64)])
