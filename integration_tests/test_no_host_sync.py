"""The fused step never makes the host wait for a device value, proven at the dispatcher.

A ``TorchDispatchMode`` sees every aten op that runs, below Python and
DTensor alike. It fails on the ops that force a device-to-host read
(``_local_scalar_dense`` behind ``item()``/``float()``/``int()``,
``is_nonzero`` behind ``bool()``, ``equal``, and ``.cpu()``-style copies out of
a device), wrapped around the whole fused step: ``unscale_and_clip_`` +
``scaler.step`` on a fused AdamW + ``scaler.update``, on an FSDP2 model over 2
real gloo ranks with the ``c10d`` backend. On these CPU ranks "device" and
host are one memory, so the mode flags the *op*, which is what would sync on
a GPU. One warm-up step runs first: the backend-chain check happens once per
backend and reads its (tiny) result, by design.

The engine learns of other ranks' errors by copying a few bytes into host
memory and reading them there (pinned and asynchronous on a GPU): an
``aten.copy_`` into a host tensor, which the mode allows, then ``tolist()``
of that host tensor, which is no dispatcher op at all.
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


def _fused_step_case(
    poison_rank: int, fused: bool, opt_kind: str = "adamw", fuse_optimizer: bool | None = None
) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardscale.clip import unscale_and_clip_
    from shardscale.core import ShardedGradScaler

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    from shardscale.core.testing import CountingGlooGroup, counting_gloo_group

    params = model.parameters()
    opt = {
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-2, fused=fused),
        "sgd": lambda: torch.optim.SGD(params, lr=1e-2, foreach=True),
        "sgd_momentum": lambda: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    }[opt_kind]()
    group = counting_gloo_group()
    scaler = ShardedGradScaler("cpu", backend="c10d", process_group=group, init_scale=1024.0)
    out: dict[str, Any] = {"seen": [], "norms": [], "skipped": [], "calls": []}
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        poison = math.inf if (step == 2 and rank == poison_rank) else 1.0
        scaler.scale(model(x).pow(2).mean() * poison).backward()
        if step == 0:  # warm-up: the one-time backend-chain check (and SGD's momentum buffers)
            unscale_and_clip_(scaler, opt, max_norm=0.5, fuse_optimizer=fuse_optimizer)
            scaler.step(opt)
            scaler.update()
            continue
        detector = HostReadRecorder()
        before = CountingGlooGroup.calls
        with detector:
            norm = unscale_and_clip_(scaler, opt, max_norm=0.5, fuse_optimizer=fuse_optimizer)
            scaler.step(opt)
            scaler.update()
        out["calls"].append(CountingGlooGroup.calls - before)
        out["seen"].append(detector.seen)
        out["norms"].append(float(norm))
        skipped = scaler.last_step_skipped
        assert skipped is not None
        out["skipped"].append(bool(skipped))
    out["finite"] = all(bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters())
    return out


@pytest.mark.parametrize(
    ("fused", "opt_kind"),
    [(True, "adamw"), (False, "adamw"), (False, "sgd"), (False, "sgd_momentum")],
    ids=["fused-adamw", "adamw-through-fused-kernel", "sgd-through-fused-kernel", "sgd-momentum"],
)
def test_fused_step_has_no_host_read_on_two_gloo_ranks(
    pool2: Pool, fused: bool, opt_kind: str
) -> None:
    # Unfused torch optimizers run through torch's fused kernel when asked (fuse_optimizer=True;
    # for SGD over FSDP2's DTensors on their local shards): no host read there either.
    results = pool2.run(_fused_step_case, 1, fused, opt_kind, None if fused else True, timeout=120)
    for res in results:
        assert isinstance(res, dict)
        assert res["seen"] == [[], [], []], res["seen"]
        assert res["calls"] == [1, 1, 1]  # the step's one collective
        # Step 2 overflowed on rank 1 only: every rank skipped it, the others stepped.
        assert res["skipped"] == [False, True, False]
        assert not math.isfinite(res["norms"][1])
        assert res["finite"]
    # Identical on both ranks, nan included (nan != nan, so compare their text).
    assert [repr(n) for n in results[0]["norms"]] == [repr(n) for n in results[1]["norms"]]  # type: ignore[index]


def test_the_detector_sees_the_one_sync_of_an_unfused_step(pool2: Pool) -> None:
    # An unfused optimizer runs on the host's say-so: the same probe must catch that read,
    # or the test above proves nothing.
    # The multiply path, asked for: the optimizer runs as built, on the host's say-so.
    results = pool2.run(_fused_step_case, 1, False, "adamw", False, timeout=120)
    for res in results:
        assert isinstance(res, dict)
        assert all("aten::_local_scalar_dense" in seen for seen in res["seen"]), res["seen"]


def _policies_case(clip: bool) -> dict[str, Any]:
    """bf16-style policies: no loss scaling, spike test, loss check, streak limit, device LR."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardscale.clip import unscale_and_clip_
    from shardscale.core import ShardedGradScaler, SpikeSkip
    from shardscale.core.testing import CountingGlooGroup, counting_gloo_group
    from shardscale.schedules import DeviceLRSchedule, WarmupSchedule

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    group = counting_gloo_group()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), fused=True)
    scaler = ShardedGradScaler(
        "cpu",
        backend="c10d",
        process_group=group,
        loss_scaling=False,
        spike=SpikeSkip(window=4, warmup=2),
        check_loss=True,
        max_consecutive_skips=3,
    )
    sched = DeviceLRSchedule(opt, WarmupSchedule(steps=3), scaler=scaler)
    out: dict[str, Any] = {"seen": [], "calls": [], "reasons": []}
    for step in range(6):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        # Step 4: a spike on rank 1 only; step 5: a nan loss (and gradients) on rank 0 only.
        factor = {4: 1e3 if rank == 1 else 1.0, 5: math.nan if rank == 0 else 1.0}.get(step, 1.0)
        loss = scaler.scale(model(x).pow(2).mean() * factor)
        loss.backward()  # FSDP2's reduce-scatter: its own collectives, not the step's
        detector = HostReadRecorder()
        before = CountingGlooGroup.calls
        with detector:
            if clip:
                unscale_and_clip_(scaler, opt, max_norm=0.5)
            scaler.step(opt)
            scaler.update()
            sched.step()
        out["calls"].append(CountingGlooGroup.calls - before)
        if step == 0:
            continue  # the one-time backend-chain check reads its result, by design
        out["seen"].append(detector.seen)
        out["reasons"].append(int(scaler.last_skip_reason))  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("clip", [False, True], ids=["step-alone", "unscale_and_clip"])
def test_every_policy_keeps_one_collective_and_no_host_read(pool2: Pool, clip: bool) -> None:
    from shardscale.core import SkipReason

    results = pool2.run(_policies_case, clip, timeout=120)
    for res in results:
        assert isinstance(res, dict)
        assert res["seen"] == [[]] * 5, res["seen"]
        # The first step also checks the backend chain once (one small all-reduce beside it).
        assert res["calls"] == [2, 1, 1, 1, 1, 1], res["calls"]
        assert res["reasons"] == [0, 0, 0, SkipReason.SPIKE, SkipReason.NONFINITE]
