"""Schedule and EMA that hold on skipped steps, on an FSDP2 model over 2 real gloo ranks.

The overflow happens on rank 1 only; every rank must skip, hold its learning
rate and its averaged weights, and do so without a host read: the whole step
(fused AdamW through the scaler, ``DeviceLRSchedule.step``,
``update_averaged_model``) runs inside ``HostReadRecorder``. The learning rate
and the averaged weights are compared with torch's own scheduler and
``AveragedModel.update_parameters`` advanced only on the taken steps.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool

from shardscale.core.testing import HostReadRecorder

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

POISON_STEP = {2, 3}


def _sharded_case() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.optim.lr_scheduler import CosineAnnealingLR
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from shardscale.core import ShardedGradScaler
    from shardscale.schedules import CosineSchedule, DeviceLRSchedule, update_averaged_model

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    # FSDP2 refuses deepcopy: the averaged copies are made first and sharded like the model.
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    ref_ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for module in (model, ema.module, ref_ema.module):
        for layer in module:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = ShardedGradScaler("cpu", backend="c10d", init_scale=1024.0)
    sched = DeviceLRSchedule(opt, CosineSchedule(steps=5, min_lr=1e-4), scaler=scaler)
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    ref_sched = CosineAnnealingLR(ref_opt, T_max=5, eta_min=1e-4)
    out: dict[str, Any] = {"seen": [], "skipped": [], "lr": [], "ref_lr": []}
    for step in range(7):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        poison = math.inf if (step in POISON_STEP and rank == 1) else 1.0
        scaler.scale(model(x).pow(2).mean() * poison).backward()
        recorder = HostReadRecorder()
        with recorder:
            scaler.step(opt)
            scaler.update()
            sched.step()
            update_averaged_model(ema, model, scaler=scaler)
        if step > 0:  # the first step checks the backend chain once, by design
            out["seen"].append(recorder.seen)
        flag = scaler.last_step_skipped
        assert flag is not None
        out["skipped"].append(bool(flag))
        if not bool(flag):
            ref_opt.step()
            ref_sched.step()
            ref_ema.update_parameters(model)
        out["lr"].append(float(opt.param_groups[0]["lr"]))
        out["ref_lr"].append(ref_sched.get_last_lr()[0])
    out["n_averaged"] = int(ema.n_averaged)
    out["ema_equal"] = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(ema.module.parameters(), ref_ema.module.parameters(), strict=True)
    )
    out["ema"] = [p.full_tensor() for p in ema.module.parameters()]
    return out


def test_schedule_and_ema_hold_on_every_rank_without_a_host_read(pool2: Pool) -> None:
    results = pool2.run(_sharded_case, timeout=120)
    for res in results:
        assert isinstance(res, dict)
        assert res["seen"] == [[]] * 6, res["seen"]
        assert res["skipped"] == [step in POISON_STEP for step in range(7)]
        # float32 lr against torch's float64 recursion: one float32 rounding of a value
        # <= 1e-2, plus < 16 units of 2**-53 per step of torch's recursion (5 steps).
        for ours, want in zip(res["lr"], res["ref_lr"], strict=True):
            assert abs(ours - want) <= 1e-2 * (2.0**-24 + 16 * 6 * 2.0**-53)
        assert res["n_averaged"] == 7 - len(POISON_STEP)
        assert res["ema_equal"]  # the same arithmetic as torch's, bit for bit
    r0, r1 = results
    assert isinstance(r0, dict) and isinstance(r1, dict)
    assert r0["lr"] == r1["lr"]
    assert all(torch.equal(a, b) for a, b in zip(r0["ema"], r1["ema"], strict=True))
