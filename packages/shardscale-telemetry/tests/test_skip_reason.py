"""The ``skip_reason`` column: JSONL and TensorBoard rows say why each skipped step was skipped.

A real single-process loop through ``ShardedGradScaler`` with the skip
policies on. Each step's expected reason is decided here from what the test
injected (a nan gradient, a finite gradient blown up past the spike
threshold, a nan loss with finite gradients, an fp16-style inf under loss
scaling), not read from the scaler.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shardscale import telemetry
from shardscale.core import LossCheck, ShardedGradScaler, SkipReason, SpikeSkip
from shardscale.core.testing import HostReadRecorder
from shardscale.telemetry import JsonlObserver

SPIKE_ABS = 50.0  # far above this model's clean norms (checked below), far below a blown-up one

# step -> what is injected there, and the reason a reader of the rows must see
NAN_GRAD, SPIKE, NAN_LOSS = 1, 3, 5
EXPECTED = {NAN_GRAD: "nonfinite", SPIKE: "spike", NAN_LOSS: "loss"}


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _policy_loop(steps: int, *, fused: bool = False) -> list[float]:
    """bf16-style training (no loss scaling) with spike and loss checks; returns each pre-clip norm.

    The norm is measured here with torch (float64) from the gradients the scaler sees.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = ShardedGradScaler(
        "cpu",
        loss_scaling=False,
        policies=[SpikeSkip(max_norm_abs=SPIKE_ABS, z=None), LossCheck()],
        backend="local",
    )
    norms = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        if step == SPIKE:
            loss = loss * 1e4  # finite gradients, 1e4 times the usual norm
        if step == NAN_LOSS:
            loss = loss + torch.tensor(math.nan)  # a nan loss whose gradients stay finite
        scaler.scale(loss).backward()
        if step == NAN_GRAD:
            model[2].weight.grad[0, 0] = math.nan
        grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.nn.utils.get_total_norm(grads, 2.0)))
        scaler.unscale_(opt, max_norm=1e9)  # measure the norm, never clip
        scaler.step(opt)
        scaler.update()
    return norms


def test_jsonl_rows_name_each_reason(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    with telemetry.enable(JsonlObserver(path), flush_every=4):
        norms = _policy_loop(7)
    lines = _lines(path)
    clean = [n for i, n in enumerate(norms) if i not in EXPECTED]
    assert max(clean) < SPIKE_ABS < norms[SPIKE] and math.isfinite(norms[SPIKE])
    assert [ln["skip_reason"] for ln in lines] == [EXPECTED.get(i) for i in range(7)]
    assert [ln["skipped"] for ln in lines] == [i in EXPECTED for i in range(7)]
    # No loss scaling: the scale stays 1 whatever the reason.
    assert {ln["scale"] for ln in lines} == {1.0}
    # Only a non-finite gradient puts ranks in overflow_ranks; a spike or a nan loss does not.
    assert [ln["overflow_ranks"] for ln in lines] == [
        [0] if i == NAN_GRAD else [] for i in range(7)
    ]


def test_overflow_under_loss_scaling_is_named_overflow(loop: Any, tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    with telemetry.enable(JsonlObserver(path), flush_every=3):
        loop.train(4, poison=frozenset({2}))
    assert [ln["skip_reason"] for ln in _lines(path)] == [None, None, "overflow", None]


def test_tensorboard_writes_the_reason_code(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with telemetry.enable(telemetry.TensorBoardObserver(tmp_path / "tb"), flush_every=3):
        _policy_loop(7)
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("shardscale/skip_reason")]
    codes = {NAN_GRAD: SkipReason.NONFINITE, SPIKE: SkipReason.SPIKE, NAN_LOSS: SkipReason.LOSS}
    assert got == [(i + 1, float(codes.get(i, SkipReason.NONE))) for i in range(7)]


def test_the_reason_costs_no_host_read_per_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reason rides in the flush's one read: per step nothing, per flush one tolist().
    callers: list[str] = []
    original = torch.Tensor.tolist

    def counting_tolist(self: torch.Tensor) -> Any:
        callers.append(sys._getframe(1).f_globals["__name__"])
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    reads: list[int] = []
    original_update = ShardedGradScaler.update

    def recorded_update(self: ShardedGradScaler, *args: Any, **kwargs: Any) -> None:
        with HostReadRecorder() as rec:
            original_update(self, *args, **kwargs)
        reads.append(len(rec.seen))

    monkeypatch.setattr(ShardedGradScaler, "update", recorded_update)
    with telemetry.enable(JsonlObserver(tmp_path / "s.jsonl"), flush_every=7):
        _policy_loop(7, fused=True)
    ours = [c for c in callers if c.startswith("shardscale.telemetry")]
    assert ours == ["shardscale.telemetry._rows"]  # 7 steps, flush_every=7: one read
    # No update() reads the host (the first may check the chain once; the 7th flushes).
    assert reads[1:-1] == [0] * 5
    assert len(_lines(tmp_path / "s.jsonl")) == 7
