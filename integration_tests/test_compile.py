"""docs/compile.md: a compiled model, or compiled scaler calls, train exactly as eager.

The scaler's and the clip functions' calls are marked to run eagerly under
torch.compile (see [Note: eager under torch.compile]): compiled, they break
the graph and behave as in eager code, instead of being traced into a graph
that replays the first step's norm and never moves the scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardscale.clip import clip_grad_norm_, unscale_and_clip_
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


def _post_processing(
    *, compiled: bool, clip: str
) -> tuple[list[tuple[float, float]], list[torch.Tensor]]:
    """The post-processing calls compiled as one function, an inf at step 2."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10)

    def fused() -> torch.Tensor:
        norm = unscale_and_clip_(scaler, optimizer, max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        return norm

    def unscale_then_clip() -> torch.Tensor:
        scaler.unscale_(optimizer)
        norm = clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        return norm

    post: Callable[[], Any] = {"fused": fused, "separate": unscale_then_clip}[clip]
    if compiled:
        post = torch.compile(post, backend="aot_eager")
    history = []
    for step in range(6):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        scaler.scale(model(x).square().sum()).backward()
        if step == 2:
            assert model.weight.grad is not None
            model.weight.grad[0, 0] = float("inf")
        history.append((float(post()), scaler.get_scale()))
        optimizer.zero_grad()
    return history, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("clip", ["fused", "separate"])
def test_compiled_scaler_calls_run_as_eager(clip: str) -> None:
    eager, eager_params = _post_processing(compiled=False, clip=clip)
    compiled, compiled_params = _post_processing(compiled=True, clip=clip)
    # Six different norms, one of them inf, and the scale halved once: a graph that replayed
    # the first step would repeat its norm and keep its scale.
    assert len({n for n, _ in eager}) == 6 and not math.isfinite(eager[2][0])
    assert [s for _, s in eager] == [2.0**10] * 2 + [2.0**9] * 4
    # The same calls run eagerly in both: identical, inf-aware.
    assert [(repr(n), s) for n, s in compiled] == [(repr(n), s) for n, s in eager]
    assert all(torch.equal(a, b) for a, b in zip(compiled_params, eager_params, strict=True))


def test_the_marks_do_not_load_torchdynamo() -> None:
    # Importing TorchDynamo costs seconds (and imports Triton where installed): importing the
    # scaler and the clip functions (the CLI's plugins and doctor do) must not pay it for the
    # eager marks. (torch's own Optimizer.__init__ loads it; a training process has it anyway.)
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from shardscale.clip import clip_grad_norm_, unscale_and_clip_\n"
        "from shardscale.core import ShardedGradScaler\n"
        "ShardedGradScaler('cpu').scale(torch.ones(()))\n"
        "clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0)\n"
        "assert 'torch._dynamo' not in sys.modules, 'the eager marks loaded TorchDynamo'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
