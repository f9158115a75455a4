"""Shared helpers: a real single-process training loop through ShardedGradScaler.

Each test starts and ends with no telemetry session and SHARDSCALE_TELEMETRY unset.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from shardscale import telemetry
from shardscale.core import ShardedGradScaler
from shardscale.core.plugins import reset_registry


@pytest.fixture(autouse=True)
def no_sessions(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(telemetry.ENV, raising=False)
    telemetry.reset()
    # A test whose observer raised leaves the plugin set aside in the process's registry.
    reset_registry()
    yield
    telemetry.reset()
    reset_registry()


@dataclass
class Truth:
    """What the test itself saw after each update (host reads made by the test, not telemetry)."""

    scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)


def train(
    steps: int,
    *,
    poison: frozenset[int] = frozenset(),
    init_scale: float = 1024.0,
    growth_interval: int = 3,
    hysteresis: int = 1,
    clip: bool = True,
) -> Truth:
    """Train a small model for ``steps`` iterations; steps (0-based) in ``poison`` get an inf grad."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = ShardedGradScaler(
        "cpu", init_scale=init_scale, growth_interval=growth_interval, hysteresis=hysteresis
    )
    truth = Truth()
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        scaler.scale(model(x).pow(2).mean()).backward()
        if step in poison:
            model[2].weight.grad[0, 0] = math.inf
        if clip:
            # The scaler's own clip (what shardscale.clip.unscale_and_clip_ fronts): this
            # distribution's tests need only shardscale-core.
            norm = scaler.unscale_(opt, max_norm=1.0)
            assert norm is not None
            truth.norms.append(float(norm))
        scaler.step(opt)
        scaler.update()
        truth.scales.append(scaler.get_scale())
        truth.skipped.append(step in poison)
    return truth


def expected_scales(
    steps: int, poison: frozenset[int], *, init: float, interval: int
) -> list[tuple[float, int]]:
    """torch.amp.GradScaler's rule, by hand: (scale, growth tracker) after each step."""
    scale, tracker, out = init, 0, []
    for step in range(steps):
        if step in poison:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == interval:
                scale, tracker = scale * 2.0, 0
        out.append((scale, tracker))
    return out


@pytest.fixture
def loop() -> type[_Loop]:
    """The helpers above (test modules cannot import conftest under --import-mode=importlib)."""
    return _Loop


class _Loop:
    train = staticmethod(train)
    expected_scales = staticmethod(expected_scales)
