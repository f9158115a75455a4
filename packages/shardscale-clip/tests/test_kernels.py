"""Every clip call reads and multiplies through the registry's chosen stats kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from shardscale.clip import clip_grad_norm_, get_total_norm, unscale_and_clip_
from shardscale.core import ForeachKernels, ShardedGradScaler, get_registry, hookimpl


class SpyKernels(ForeachKernels):
    """Foreach kernels that record what they are asked to do (highest priority: chosen first)."""

    name: ClassVar[str] = "spy"
    priority: ClassVar[int] = 1000

    def __init__(self) -> None:
        self.reads = 0
        self.muls = 0

    def tensor_norms(self, tensors: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        self.reads += len(tensors)
        return super().tensor_norms(tensors, norm_type)

    def mul_(self, tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
        self.muls += len(tensors)
        super().mul_(tensors, coef)


class SpyPlugin:
    def __init__(self) -> None:
        self.kernels = SpyKernels()

    @hookimpl
    def shardscale_stats_kernels(self) -> Sequence[object]:
        return [self.kernels]


def test_every_read_and_multiply_goes_through_the_chosen_kernels() -> None:
    plugin = SpyPlugin()
    registry = get_registry()
    name = registry.register(plugin, name="clip-spy")
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        n_params = len(list(model.parameters()))
        model(torch.randn(3, 4)).sum().backward()
        get_total_norm([q.grad for q in model.parameters()])  # type: ignore[misc]
        assert (plugin.kernels.reads, plugin.kernels.muls) == (n_params, 0)
        clip_grad_norm_(model.parameters(), 1e-3)
        assert (plugin.kernels.reads, plugin.kernels.muls) == (2 * n_params, n_params)
        # One read and one multiply per gradient for an unfused optimizer...
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ShardedGradScaler("cpu", backend="local")
        scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        unscale_and_clip_(scaler, opt, 1.0, fuse_optimizer=False)  # the multiply, not the kernel
        assert (plugin.kernels.reads, plugin.kernels.muls) == (3 * n_params, 2 * n_params)
        # ... and foreach=False bypasses it for the loop kernels.
        clip_grad_norm_(model.parameters(), 1e-3, foreach=False)
        assert (plugin.kernels.reads, plugin.kernels.muls) == (3 * n_params, 2 * n_params)
        # A fused optimizer: one read, no multiply.
        fused = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
        scaler.step(opt)
        scaler.update()
        scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        unscale_and_clip_(scaler, fused, 1.0)
        assert (plugin.kernels.reads, plugin.kernels.muls) == (4 * n_params, 2 * n_params)
    finally:
        registry.unregister(name)
