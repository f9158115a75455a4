"""One contract (issue 18): every front end refuses a bad option with the same text, and
``ShardedGradScaler.clip_grad_norm_`` is torch's ``clip_grad_norm_`` with the scaler's config.

State-unchanged checks for each refusal are in ``test_bad_input.py`` (its table compares
a full snapshot); here the point is that the *text* and the *type* do not depend on the door.
"""

from __future__ import annotations

import gc
import importlib.util
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardscale.core import ShardedGradScaler

HAVE_CLIP = importlib.util.find_spec("shardscale.clip") is not None
HAVE_CLI = importlib.util.find_spec("shardscale.cli") is not None


def _world(
    *, unscaled: bool = False, enabled: bool = True
) -> tuple[ShardedGradScaler, torch.optim.Optimizer, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = ShardedGradScaler("cpu", backend="local", enabled=enabled, init_scale=8.0)
    scaler.scale(model(torch.randn(5, 4)).square().mean()).backward()
    if unscaled:
        scaler.unscale_(opt)
    return scaler, opt, params


Door = Callable[[Any, Any], object]


def _doors() -> dict[str, Door]:
    """Every way a user hands max_norm and norm_type to a step."""

    def unscale(max_norm: Any, norm_type: Any) -> object:
        scaler, opt, _ = _world()
        return scaler.unscale_(opt, max_norm=max_norm, norm_type=norm_type)

    def unscale_disabled(max_norm: Any, norm_type: Any) -> object:
        scaler, opt, _ = _world(enabled=False)
        return scaler.unscale_(opt, max_norm=max_norm, norm_type=norm_type)

    def scaler_clip(max_norm: Any, norm_type: Any) -> object:
        scaler, _, params = _world(unscaled=True)
        return scaler.clip_grad_norm_(params, max_norm, norm_type)

    doors: dict[str, Door] = {
        "scaler.unscale_": unscale,
        "scaler.unscale_ (disabled)": unscale_disabled,
        "scaler.clip_grad_norm_": scaler_clip,
    }
    if HAVE_CLIP:
        from shardscale import clip

        def clip_fn(max_norm: Any, norm_type: Any) -> object:
            _, _, params = _world(unscaled=True)
            return clip.clip_grad_norm_(params, max_norm, norm_type)

        def fused(max_norm: Any, norm_type: Any) -> object:
            scaler, opt, _ = _world()
            return clip.unscale_and_clip_(scaler, opt, max_norm, norm_type)

        def fused_disabled(max_norm: Any, norm_type: Any) -> object:
            scaler, opt, _ = _world(enabled=False)
            return clip.unscale_and_clip_(scaler, opt, max_norm, norm_type)

        doors |= {
            "clip.clip_grad_norm_": clip_fn,
            "clip.unscale_and_clip_": fused,
            "clip.unscale_and_clip_ (disabled)": fused_disabled,
        }
    return doors


BAD = [
    pytest.param(-1.0, 2.0, id="max_norm=-1"),  # flipped every gradient's sign
    pytest.param(float("nan"), 2.0, id="max_norm=nan"),  # filled every gradient with nan
    pytest.param(0.0, 2.0, id="max_norm=0"),
    pytest.param(True, 2.0, id="max_norm=True"),
    pytest.param("lots", 2.0, id="max_norm=str"),
    pytest.param(1.0, 0, id="norm_type=0"),  # ZeroDivisionError
    pytest.param(1.0, -2.0, id="norm_type=-2"),
    pytest.param(1.0, float("nan"), id="norm_type=nan"),
]


@pytest.mark.parametrize(("max_norm", "norm_type"), BAD)
def test_every_door_refuses_with_the_same_error(max_norm: Any, norm_type: Any) -> None:
    seen: dict[str, tuple[type, str]] = {}
    for name, door in _doors().items():
        with pytest.raises((TypeError, ValueError)) as info:
            door(max_norm, norm_type)
        seen[name] = (type(info.value), str(info.value))
    assert len(set(seen.values())) == 1, seen
    ((_kind, text),) = set(seen.values())
    # The text names the option and says what is accepted.
    assert ("max_norm" if norm_type == 2.0 else "norm_type") in text
    assert "got" in text


@pytest.mark.skipif(not HAVE_CLI, reason="the shardscale CLI is not installed")
@pytest.mark.parametrize("value", [-1.0, float("nan"), 0.0])
def test_the_cli_reports_the_contract_text(value: float) -> None:
    from shardscale.cli._trainer import check_config_values
    from shardscale.core.step import check_max_norm

    with pytest.raises(ValueError) as core:
        check_max_norm(value)
    with pytest.raises(ValueError) as cli:
        check_config_values({"max_norm": value}, cli=True)
    assert str(cli.value).startswith(f"--max-norm: {core.value}")


def test_a_refused_unscale_leaves_the_gradients_alone() -> None:
    # Item 1 as the user met it: max_norm=-1.0 flipped every gradient's sign.
    scaler, opt, params = _world()
    before = [p.grad.clone() for p in params if p.grad is not None]
    with pytest.raises(ValueError, match="max_norm"):
        scaler.unscale_(opt, max_norm=-1.0)
    after = [p.grad for p in params if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    # Still READY: the legal call that follows unscales once, as torch's unscale_ would.
    norm = scaler.unscale_(opt, max_norm=math.inf)
    assert norm is not None and math.isfinite(float(norm))


# -- clip_grad_norm_ with the scaler's configuration ------------------------------------------


def _grads(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(3)
    params = []
    for shape in [(7, 5), (5,), (3, 7), (1,)]:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) * 3
        params.append(p)
    return params


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, math.inf])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("enabled", [True, False])
def test_scaler_clip_grad_norm_is_torch_on_one_process(
    norm_type: float, max_norm: float, dtype: torch.dtype, enabled: bool
) -> None:
    ours, theirs = _grads(dtype), _grads(dtype)
    scaler = ShardedGradScaler("cpu", backend="local", enabled=enabled)
    got = scaler.clip_grad_norm_(ours, max_norm, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert got.dtype == want.dtype
    # A p-norm of n = 62 values summed in the accumulation dtype (unit roundoff u):
    # relative error <= (n + 8)·u·max(1, 1/p)·2 + u for each side (see
    # integration_tests/tolerances.py), so the two agree within twice that; the clipped
    # gradients add the float32 coefficient's rounding (2 eps) and one of their own dtype.
    u = torch.finfo(dtype).eps / 2
    rtol = 2 * ((62 + 8) * u * 2 + u)
    torch.testing.assert_close(got, want, rtol=rtol, atol=0.0)
    grad_rtol = rtol + 2 * torch.finfo(torch.float32).eps + torch.finfo(dtype).eps
    for a, b in zip(ours, theirs, strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=grad_rtol, atol=0.0)
    # What telemetry logs as the step's norm.
    assert scaler._last_grad_norm is got


def test_scaler_clip_grad_norm_takes_one_tensor_and_skips_gradless_ones() -> None:
    params = _grads(torch.float32)
    params[1].grad = None
    scaler = ShardedGradScaler("cpu", backend="local")
    want = torch.linalg.vector_norm(
        torch.cat([p.grad.flatten() for p in params if p.grad is not None])
    )
    got = scaler.clip_grad_norm_(params, math.inf)
    # Same n = 57 values, float32: as above.
    u = torch.finfo(torch.float32).eps / 2
    torch.testing.assert_close(got, want, rtol=2 * ((57 + 8) * u * 2 + u), atol=0.0)
    one = scaler.clip_grad_norm_(params[0], math.inf)
    assert params[0].grad is not None
    torch.testing.assert_close(
        one, torch.linalg.vector_norm(params[0].grad), rtol=2 * ((35 + 8) * u * 2 + u), atol=0.0
    )


def test_scaler_clip_grad_norm_error_if_nonfinite_changes_nothing() -> None:
    params = _grads(torch.float32)
    assert params[2].grad is not None
    params[2].grad[0, 0] = math.inf
    before = [p.grad.clone() for p in params if p.grad is not None]
    scaler = ShardedGradScaler("cpu", backend="local")
    with pytest.raises(RuntimeError, match="non-finite"):
        scaler.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    for p, b in zip(params, before, strict=True):
        assert p.grad is not None and torch.equal(p.grad, b)


# -- distinct_params of a scaler that steps several optimizers -----------------------------------


def _two_optimizers() -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]
    b = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(5))]
    return a, b


def _backward(scaler: ShardedGradScaler, params: list[torch.nn.Parameter]) -> None:
    scaler.scale(sum((p * p).sum() for p in params)).backward()  # type: ignore[union-attr]


def test_declared_params_of_another_optimizer_are_not_strangers() -> None:
    from shardscale.core import DeclarationError

    a, b = _two_optimizers()
    opt_a, opt_b = torch.optim.SGD(a, lr=0.1), torch.optim.SGD(b, lr=0.1)
    scaler = ShardedGradScaler("cpu", backend="local", distinct_params=b[:1])
    for _ in range(2):  # the first iteration, before opt_b was ever seen, and the second
        _backward(scaler, a + b)
        for opt in (opt_a, opt_b):
            norm = scaler.unscale_(opt, max_norm=math.inf)
            assert norm is not None and math.isfinite(float(norm))
            scaler.step(opt)
        scaler.update()
        opt_a.zero_grad()
        opt_b.zero_grad()
    # A third optimizer's stranger: refused once the scaler has seen a whole iteration.
    c = [torch.nn.Parameter(torch.randn(6))]
    other = ShardedGradScaler("cpu", backend="local", distinct_params=c)
    opt_c = torch.optim.SGD(c, lr=0.1)
    _backward(other, a + c)
    other.unscale_(opt_a, max_norm=math.inf)  # c holds a gradient: maybe another optimizer's
    other.step(opt_a)
    other.unscale_(opt_c, max_norm=math.inf)
    other.step(opt_c)
    other.update()
    del opt_c  # no optimizer of this scaler holds c any more
    gc.collect()
    opt_a.zero_grad()
    _backward(other, a + c)
    before = [p.grad.clone() for p in a]  # type: ignore[union-attr]
    with pytest.raises(DeclarationError, match=r"holds 1 tensor\(s\) .*not parameters of any"):
        other.unscale_(opt_a, max_norm=math.inf)
    assert all(torch.equal(p.grad, g) for p, g in zip(a, before, strict=True))  # type: ignore[arg-type]


def test_declared_params_without_a_gradient_outside_every_optimizer_are_refused_at_once() -> None:
    from shardscale.core import DeclarationError

    a, _ = _two_optimizers()
    stale = [torch.nn.Parameter(p.detach().clone()) for p in a]  # as before fully_shard
    opt = torch.optim.SGD(a, lr=0.1)
    scaler = ShardedGradScaler("cpu", backend="local", distinct_params=stale)
    _backward(scaler, a)
    with pytest.raises(DeclarationError, match="would be ignored"):
        scaler.unscale_(opt, max_norm=1.0)
    assert scaler._per_optimizer_states[id(opt)]["stage"].name == "READY"
