"""Using the example plugin in one process (docs/writing-a-plugin.md)."""

from __future__ import annotations

import shardscale_steplog
import torch
from torch import nn

from shardscale.clip import unscale_and_clip_
from shardscale.core import ShardedGradScaler, get_registry


def run(steps: int = 3) -> ShardedGradScaler:
    """Train a few steps with ``steplog+local``; the middleware and observer record them."""
    registry = get_registry()
    # Installed as a distribution, the entry point registers it; here we do it by hand.
    name = registry.register(shardscale_steplog, name="steplog")
    try:
        model = nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ShardedGradScaler("cpu", backend="steplog+local")
        for _ in range(steps):
            loss = model(torch.randn(4, 8)).square().mean()
            scaler.scale(loss).backward()
            unscale_and_clip_(scaler, optimizer, max_norm=1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        return scaler
    finally:
        registry.unregister(name)
