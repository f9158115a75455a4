"""docs/compile.md: a compiled model with the scaler calls outside it trains exactly as eager."""

from __future__ import annotations

import math

import torch

from shardscale.clip import unscale_and_clip_
from shardscale.core import ShardedGradScaler


def _train(*, compiled: bool) -> tuple[list[tuple[float, float]], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    # aot_eager traces forward and backward through AOTAutograd as inductor does, without
    # generating C++ (minutes on this CPU); docs/compile.md reports inductor's run too.
    forward = torch.compile(model, backend="aot_eager") if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**20)  # the first steps overflow fp16
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    y = x[:, :4].sum(-1, keepdim=True)
    history = []
    for _ in range(12):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(forward(x).float(), y)
        scaler.scale(loss).backward()
        norm = unscale_and_clip_(scaler, optimizer, max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        history.append((float(norm), scaler.get_scale()))
    return history, [p.detach().clone() for p in model.parameters()]


def test_compiled_model_with_eager_scaler_matches_eager_bit_for_bit() -> None:
    eager, eager_params = _train(compiled=False)
    compiled, compiled_params = _train(compiled=True)
    # Real overflows happened (and were skipped), then real steps.
    assert any(not math.isfinite(n) for n, _ in eager) and math.isfinite(eager[-1][0])
    assert eager[-1][1] < 2.0**20
    # Same program, same kernels for the math: identical, nan-aware.
    assert [(repr(n), s) for n, s in compiled] == [(repr(n), s) for n, s in eager]
    assert all(torch.equal(a, b) for a, b in zip(compiled_params, eager_params, strict=True))
