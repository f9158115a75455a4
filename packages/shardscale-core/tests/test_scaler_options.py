"""Options beyond torch: the option objects, hysteresis, scale bounds and the per-step record hook."""

from __future__ import annotations

import math

import pytest
import torch

from shardscale.core import ScaleBounds, ShardedGradScaler
from shardscale.core.testing import recording_steps


def _drive(scaler: ShardedGradScaler, overflow_steps: set[int], n: int) -> list[float]:
    """Run n iterations of a one-parameter model, overflowing at the given steps."""
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.0)
    scales = []
    for step in range(n):
        opt.zero_grad()
        loss = param.sum() * (math.inf if step in overflow_steps else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _expected(
    overflow_steps: set[int],
    n: int,
    *,
    init: float,
    growth: float,
    backoff: float,
    interval: int,
    hysteresis: int,
    lo: float | None = None,
    hi: float | None = None,
) -> list[float]:
    """An independent statement of the rule: back off only on the N-th consecutive overflow."""
    scale, clean, left = init, 0, hysteresis
    out = []
    for step in range(n):
        if step in overflow_steps:
            clean = 0
            if left <= 1:
                scale *= backoff
            left = max(left - 1, 1)
        else:
            left = hysteresis
            clean += 1
            if clean == interval:
                scale *= growth
                clean = 0
        if lo is not None:
            scale = max(scale, lo)
        if hi is not None:
            scale = min(scale, hi)
        out.append(scale)
    return out


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_hysteresis_backs_off_only_after_consecutive_overflows(hysteresis: int) -> None:
    overflow = {2, 3, 4, 8, 11, 12}
    kw = {"init_scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3}
    got = _drive(
        ShardedGradScaler(
            "cpu", backend="local", loss_scaling=ScaleBounds(hysteresis=hysteresis), **kw
        ),
        overflow,
        16,
    )
    want = _expected(
        overflow, 16, init=1024.0, growth=2.0, backoff=0.5, interval=3, hysteresis=hysteresis
    )
    assert got == want


def test_hysteresis_one_with_bounds_matches_torch_inside_the_bounds() -> None:
    overflow = {0, 1, 2, 3, 4, 5}
    kw = {"init_scale": 64.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1}
    got = _drive(
        ShardedGradScaler(
            "cpu", backend="local", loss_scaling=ScaleBounds(min_scale=8.0, max_scale=256.0), **kw
        ),
        overflow,
        14,
    )
    want = _expected(
        overflow, 14, init=64.0, growth=2.0, backoff=0.5, interval=1, hysteresis=1, lo=8.0, hi=256.0
    )
    assert got == want
    assert min(got) == 8.0 and max(got) == 256.0


def test_defaults_produce_torch_keys_only() -> None:
    assert set(ShardedGradScaler("cpu", backend="local").state_dict()) == set(
        torch.amp.GradScaler("cpu").state_dict()
    )


def test_options_survive_a_state_dict_round_trip() -> None:
    bounds = ScaleBounds(hysteresis=3, min_scale=2.0, max_scale=1e6)
    a = ShardedGradScaler("cpu", backend="local", loss_scaling=bounds)
    _drive(a, {1}, 3)
    b = ShardedGradScaler("cpu", backend="local")
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert b.get_hysteresis() == 3
    assert b.scale_bounds == bounds  # the checkpoint's bounds replaced the defaults


def test_step_records_reach_plugins_after_update() -> None:
    with recording_steps() as recorder:
        scaler = ShardedGradScaler("cpu", backend="local", init_scale=16.0, growth_interval=100)
        scales = _drive(scaler, {1}, 3)
    assert [r.step for r in recorder.records] == [1, 2, 3]
    assert [bool(r.skipped) for r in recorder.records] == [False, True, False]
    assert [float(r.scale) for r in recorder.records] == scales
    assert [int(r.growth_tracker) for r in recorder.records] == [1, 0, 1]
    assert all(r.grad_norm is None for r in recorder.records)
    # unregistered: no more records
    _drive(ShardedGradScaler("cpu", backend="local"), set(), 1)
    assert len(recorder.records) == 3


def test_scale_tensor_is_the_live_scale_without_a_read() -> None:
    scaler = ShardedGradScaler("cpu", init_scale=64.0)
    assert scaler.scale_tensor is None  # before the first scale()
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale((w * math.inf).sum()).backward()
    live = scaler.scale_tensor
    assert live is not None and live.dtype == torch.float32 and live.shape == ()
    scaler.step(opt)
    scaler.update()
    # The same tensor, updated in place: torch's backoff on an overflow halves it.
    assert scaler.scale_tensor is live and float(live) == 32.0 == scaler.get_scale()
    assert ShardedGradScaler("cpu", enabled=False).scale_tensor is None
