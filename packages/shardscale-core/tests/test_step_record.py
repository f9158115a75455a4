"""StepRecord carries the hysteresis tracker and each rank's non-finite count, as device tensors."""

from __future__ import annotations

import math

import torch

from shardscale.core import ScaleBounds, ShardedGradScaler
from shardscale.core.testing import recording_steps


def test_hysteresis_tracker_and_nonfinite_counts_of_two_optimizers() -> None:
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.0), torch.optim.SGD([b], lr=0.0)
    scaler = ShardedGradScaler(
        "cpu", backend="local", init_scale=8.0, loss_scaling=ScaleBounds(hysteresis=2)
    )
    with recording_steps() as recorder:
        for step in range(4):
            opt_a.zero_grad()
            opt_b.zero_grad()
            # step 1: both optimizers' gradients overflow; step 2: only b's
            bad_a = math.inf if step == 1 else 1.0
            bad_b = math.inf if step in (1, 2) else 1.0
            scaler.scale(a.sum() * bad_a + b.sum() * bad_b).backward()
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
    records = recorder.records
    assert [int(r.hysteresis_tracker) for r in records] == [2, 1, 1, 2]  # type: ignore[arg-type]
    assert [float(r.scale) for r in records] == [8.0, 8.0, 4.0, 4.0]
    counts = [r.nonfinite_per_rank for r in records]
    assert all(c is not None and c.shape == (1,) and c.device.type == "cpu" for c in counts)
    # Summed over the iteration's engine steps: one per optimizer whose gradient was bad.
    assert [int(c[0]) for c in counts] == [0, 2, 1, 0]  # type: ignore[index]


def test_update_with_new_scale_makes_no_record() -> None:
    with recording_steps() as recorder:
        p = torch.nn.Parameter(torch.ones(2))
        scaler = ShardedGradScaler("cpu", backend="local")
        scaler.scale(p.sum()).backward()
        scaler.update(new_scale=2.0)
    assert recorder.records == []
