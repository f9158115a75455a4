"""The fused step never asks the host for a device value.

CUDA's sync debug mode is GPU-only; on every device the Python-visible ways a
tensor's value reaches the host are ``item``, ``tolist``, ``__bool__``,
``__float__``, ``__int__`` and ``__index__``. These tests make each of them
raise while ``unscale_and_clip_`` + ``scaler.step`` (fused optimizer) +
``scaler.update`` run, so a future ``.item()`` on that path fails here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from shardscale.clip import unscale_and_clip_
from shardscale.core import ShardedGradScaler

_HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


class HostSync(AssertionError):
    pass


@contextlib.contextmanager
def forbid_host_reads() -> Iterator[list[str]]:
    seen: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def make(name: str) -> Any:
        def refuse(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            seen.append(name)
            raise HostSync(f"host read via Tensor.{name} on the fused path")

        return refuse

    try:
        for name in _HOST_READS:
            setattr(torch.Tensor, name, make(name))
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _setup(fused: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, ShardedGradScaler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
    return model, opt, ShardedGradScaler("cpu", backend="local", init_scale=1024.0)


@pytest.mark.parametrize("poison", [1.0, float("inf")], ids=["clean", "overflow"])
def test_fused_optimizer_step_has_no_host_read(poison: float) -> None:
    model, opt, scaler = _setup(fused=True)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = model(torch.randn(4, 8)).pow(2).mean() * poison
        scaler.scale(loss).backward()
        with forbid_host_reads() as seen:
            norm = unscale_and_clip_(scaler, opt, max_norm=0.5)
            scaler.step(opt)
            scaler.update()
        assert seen == []
        assert bool(torch.isfinite(norm)) is (poison == 1.0)


def test_the_probe_catches_the_one_sync_of_an_unfused_step() -> None:
    # The unfused optimizer step needs the host to decide whether to run: the probe must see it.
    model, opt, scaler = _setup(fused=False)
    scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
    unscale_and_clip_(scaler, opt, max_norm=0.5)
    with pytest.raises(HostSync), forbid_host_reads():
        scaler.step(opt)
