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


def _fused_step_case(poison_rank: int, fused: bool) -> dict[str, Any]:
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
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = ShardedGradScaler("cpu", backend="c10d", init_scale=1024.0)
    out: dict[str, Any] = {"seen": [], "norms": [], "skipped": []}
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        poison = math.inf if (step == 2 and rank == poison_rank) else 1.0
        scaler.scale(model(x).pow(2).mean() * poison).backward()
        if step == 0:  # warm-up: the one-time backend-chain check
            unscale_and_clip_(scaler, opt, max_norm=0.5)
            scaler.step(opt)
            scaler.update()
            continue
        detector = HostReadRecorder()
        with detector:
            norm = unscale_and_clip_(scaler, opt, max_norm=0.5)
            scaler.step(opt)
            scaler.update()
        out["seen"].append(detector.seen)
        out["norms"].append(float(norm))
        skipped = scaler.last_step_skipped
        assert skipped is not None
        out["skipped"].append(bool(skipped))
    out["finite"] = all(bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters())
    return out


def test_fused_step_has_no_host_read_on_two_gloo_ranks(pool2: Pool) -> None:
    results = pool2.run(_fused_step_case, 1, True, timeout=120)
    for res in results:
        assert isinstance(res, dict)
        assert res["seen"] == [[], [], []], res["seen"]
        # Step 2 overflowed on rank 1 only: every rank skipped it, the others stepped.
        assert res["skipped"] == [False, True, False]
        assert not math.isfinite(res["norms"][1])
        assert res["finite"]
    # Identical on both ranks, nan included (nan != nan, so compare their text).
    assert [repr(n) for n in results[0]["norms"]] == [repr(n) for n in results[1]["norms"]]  # type: ignore[index]


def test_the_detector_sees_the_one_sync_of_an_unfused_step(pool2: Pool) -> None:
    # An unfused optimizer runs on the host's say-so: the same probe must catch that read,
    # or the test above proves nothing.
    results = pool2.run(_fused_step_case, 1, False, timeout=120)
    for res in results:
        assert isinstance(res, dict)
        assert all("aten::_local_scalar_dense" in seen for seen in res["seen"]), res["seen"]
