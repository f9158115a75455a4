"""The benchmark model, its sharding (FSDP2, or TP + FSDP2) and the optimizers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["Net", "TinyParams", "make_optimizer", "shard"]


class _Block(nn.Module):
    """A residual MLP block: the up projection is split by columns under TP, the down by rows."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.nn.functional.gelu(self.up(x)))
        return out


class Net(nn.Module):
    """``blocks`` residual MLP blocks of ``width`` -> ``hidden`` -> ``width``."""

    def __init__(self, *, width: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width, hidden) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class TinyParams(nn.Module):
    """``count`` parameters of ``numel`` elements each: the scaling table's model."""

    def __init__(self, *, count: int, numel: int) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.randn(numel)) for _ in range(count))

    def forward(self) -> torch.Tensor:
        # One small term per parameter, so that backward gives every parameter a gradient.
        total = torch.stack([(p * p).sum() for p in self.params]).sum()
        return total


def shard(model: Net, shape: tuple[int, ...], device: str) -> tuple[Net, int]:
    """FSDP2 over ``(dp,)`` or TP + FSDP2 over ``(dp, tp)``, in place; returns this rank's dp index."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Parameters stay gathered between forward and backward: one all-gather less per step;
    # the benchmark is about what happens after backward.
    reshard = False
    if len(shape) == 1:
        mesh = init_device_mesh(device, shape, mesh_dim_names=("dp",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return model, mesh.get_local_rank()
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(device, shape, mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=reshard)
    return model, mesh["dp"].get_local_rank()


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    """``sgd`` (foreach) or ``adam_fused`` (the optimizer then receives grad_scale from ours)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=True)
    if name == "adam_fused":
        return torch.optim.Adam(params, lr=1e-4, fused=True)
    raise ValueError(f"unknown optimizer {name!r}")
