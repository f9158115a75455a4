"""The scaler is a ``torch.distributed.checkpoint`` Stateful beside an FSDP2 model and optimizer.

Two ranks (gloo) train an FSDP2 model with Adam and ``ShardedGradScaler`` for
``TOTAL`` steps, an inf injected on one rank at a few steps, without
interruption. Then the same training runs to step ``SPLIT``, is saved with
``dcp.save`` (model and optimizer through ``get_state_dict``, the scaler as
itself), and is resumed in a *fresh* model, optimizer and scaler (built with a
different initial scale, so only the checkpoint can make it right) via
``dcp.load``. From the resume on, every step's scale and every parameter must
be bit-identical to the uninterrupted run. The split falls mid growth interval,
so a lost growth tracker would show.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool
from torch import nn

from shardscale.core import ShardedGradScaler

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

TOTAL = 10
SPLIT = 4
INF_STEPS = frozenset({1, 6, 7})
GROWTH_INTERVAL = 3
INIT_SCALE = 2.0**8


class _AppState:
    """Model and optimizer as one DCP Stateful, the way torch's DCP recipe does it."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


def _build(init_scale: float) -> tuple[nn.Module, torch.optim.Optimizer, ShardedGradScaler]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = ShardedGradScaler(
        "cpu", init_scale=init_scale, growth_interval=GROWTH_INTERVAL, backend="c10d"
    )
    return model, opt, scaler


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, scaler: ShardedGradScaler, steps: range
) -> list[tuple[bytes, list[list[int]]]]:
    """Per step: the scale's bits and every full parameter's bits."""
    rank, world = dist.get_rank(), dist.get_world_size()
    trace = []
    for step in steps:
        batch = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        scaler.scale(model(batch.chunk(world)[rank]).square().mean()).backward()
        if step in INF_STEPS and rank == world - 1:
            grad = next(p.grad for p in model.parameters() if p.grad.to_local().numel())  # type: ignore[union-attr]
            grad.to_local().view(-1)[0] = math.inf  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
        params = [
            p.detach().full_tensor().view(-1).view(torch.int32).tolist()  # type: ignore[attr-defined]
            for p in model.parameters()
        ]
        trace.append((struct.pack("<f", scaler.get_scale()), params))
    return trace


def _case_resume(directory: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    model, opt, scaler = _build(INIT_SCALE)
    uninterrupted = _train(model, opt, scaler, range(TOTAL))

    model, opt, scaler = _build(INIT_SCALE)
    head = _train(model, opt, scaler, range(SPLIT))
    saved_state = scaler.state_dict()
    dcp.save({"app": _AppState(model, opt), "scaler": scaler}, checkpoint_id=directory)

    model, opt, scaler = _build(init_scale=7.0)  # wrong on purpose: only the checkpoint fixes it
    dcp.load({"app": _AppState(model, opt), "scaler": scaler}, checkpoint_id=directory)
    loaded_state = scaler.state_dict()
    resumed = _train(model, opt, scaler, range(SPLIT, TOTAL))
    return {
        "head_matches": head == uninterrupted[:SPLIT],
        "saved_state": saved_state,
        "loaded_state": loaded_state,
        "tail_matches": [a == b for a, b in zip(resumed, uninterrupted[SPLIT:], strict=True)],
        "scales": [struct.unpack("<f", s)[0] for s, _ in uninterrupted],
    }


def test_resume_from_dcp_is_bit_identical(pool2: Pool, tmp_path: Path) -> None:
    pytest.importorskip("shardscale.fsdp")
    results = pool2.run(_case_resume, str(tmp_path / "ckpt"), timeout=180)
    for res in results:
        assert isinstance(res, dict)
        assert res["head_matches"]
        assert res["loaded_state"] == res["saved_state"]
        # Mid growth interval at the split, after a back-off: the tracker matters.
        assert 0 < res["saved_state"]["_growth_tracker"] < GROWTH_INTERVAL
        assert res["saved_state"]["scale"] != INIT_SCALE
        assert all(res["tail_matches"]), res["tail_matches"]
        # The tail grows and backs off again, so the restored tracker and scale were used.
        tail = res["scales"][SPLIT:]
        assert max(tail) > res["saved_state"]["scale"] > min(tail)
    assert results[0] == results[1]  # type: ignore[comparison-overlap]
