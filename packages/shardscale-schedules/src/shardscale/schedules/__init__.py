"""shardscale.schedules: learning-rate schedules and averaged weights that hold on skipped steps.

They follow the verdict of ``shardscale.core.ShardedGradScaler`` (its public
``last_step_skipped``, identical on every rank) so that a skipped step moves
neither the learning rate nor the averaged weights. Quick start::

    from shardscale.core import ShardedGradScaler
    from shardscale.schedules import (
        CosineSchedule, DeviceLRSchedule, WarmupSchedule, update_averaged_model,
    )

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    scaler = ShardedGradScaler("cuda")
    sched = DeviceLRSchedule(
        opt, WarmupSchedule(steps=100, then=CosineSchedule(steps=900)), scaler=scaler
    )
    ...
    scaler.step(opt)
    scaler.update()
    sched.step()                                     # no host read
    update_averaged_model(ema, model, scaler=scaler)  # an AveragedModel, on taken steps only

For any torch scheduler, :class:`SkipAwareScheduler` holds it on skipped steps,
deciding on the host one step late (see docs/skipped-steps.md).
"""

from __future__ import annotations

from shardscale.schedules._ema import update_averaged_model
from shardscale.schedules._held_scheduler import DeferredStep, SkipAwareScheduler
from shardscale.schedules._lr_schedule import (
    ConstantSchedule,
    CosineSchedule,
    DeviceLRSchedule,
    ExponentialSchedule,
    LinearSchedule,
    LRSchedule,
    StepSchedule,
    WarmupSchedule,
)
from shardscale.schedules._skip_signal import SkipSource

__all__ = [
    # where the skip flag comes from (ShardedGradScaler is one)
    "SkipSource",
    # learning-rate schedules on the device, from a counter of taken steps
    "DeviceLRSchedule",
    "LRSchedule",
    "ConstantSchedule",
    "LinearSchedule",
    "CosineSchedule",
    "StepSchedule",
    "ExponentialSchedule",
    "WarmupSchedule",
    # any torch scheduler, held on skipped steps (decided on the host, one step late)
    "SkipAwareScheduler",
    "DeferredStep",
    # averaged weights (SWA/EMA) updated on taken steps only
    "update_averaged_model",
]
