"""Schedules and averaged weights after spike skips: torch's, advanced on the taken steps only.

The scaler's verdict here comes from a spike policy and a checked loss (not an
overflow): whatever the reason, ``DeviceLRSchedule`` and ``update_averaged_model``
hold on the skipped steps, read nothing on the host, and equal torch's
``LinearLR`` and ``AveragedModel`` stepped only on the steps the rule takes.
"""

from __future__ import annotations

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from shardscale.core import ShardedGradScaler, SpikeSkip
from shardscale.core.testing import HostReadRecorder
from shardscale.schedules import DeviceLRSchedule, LinearSchedule, update_averaged_model


def test_lr_and_ema_after_spike_skips_equal_a_reference_advanced_on_taken_steps() -> None:
    model = torch.nn.Linear(4, 2)
    ref_model = torch.nn.Linear(4, 2)
    ref_model.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.01)
    scaler = ShardedGradScaler(
        "cpu", loss_scaling=False, spike=SpikeSkip(max_norm_abs=20.0, z=None), check_loss=True
    )
    sched = DeviceLRSchedule(
        opt, LinearSchedule(steps=10, start_factor=1.0, end_factor=0.1), scaler=scaler
    )
    ref_sched = torch.optim.lr_scheduler.LinearLR(
        ref_opt, start_factor=1.0, end_factor=0.1, total_iters=10
    )
    avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ref_avg = AveragedModel(ref_model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    spikes = {2, 3, 6}
    seen: list[list[str]] = []
    for step in range(9):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        factor = 1e3 if step in spikes else 1.0
        for m in (model, ref_model):
            m.zero_grad()
        loss = model(x).square().mean() * factor
        scaler.scale(loss).backward()
        if step not in spikes:  # the reference takes only the steps the rule takes
            (ref_model(x).square().mean() * factor).backward()
            ref_opt.step()
            ref_sched.step()
            ref_avg.update_parameters(ref_model)
        with HostReadRecorder() as detector:
            scaler.step(opt)
            scaler.update()
            sched.step()
            update_averaged_model(avg, model, scaler=scaler)
        seen.append(detector.seen)
    assert seen == [[]] * 9
    # Fused vs for-loop AdamW over 6 taken steps: float32 rounding only.
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(ref_sched.get_last_lr()[0], rel=1e-6)
    for a, b in zip(avg.module.parameters(), ref_avg.module.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    assert int(avg.n_averaged) == int(ref_avg.n_averaged) == 9 - len(spikes)
