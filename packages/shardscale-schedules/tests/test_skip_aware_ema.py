"""Averaged weights that hold on skipped steps, and a whole step that never reads the device.

``update_averaged_model`` is compared with torch's own ``AveragedModel.update_parameters``
called only on the taken steps: the same arithmetic, so the results must be equal, not close.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim.swa_utils import (
    AveragedModel,
    get_ema_avg_fn,
    get_ema_multi_avg_fn,
)

import shardscale.schedules._ema as ema_module
from shardscale.core import ShardedGradScaler
from shardscale.core.testing import HostReadRecorder
from shardscale.schedules import (
    CosineSchedule,
    DeviceLRSchedule,
    SkipAwareScheduler,
    WarmupSchedule,
    update_averaged_model,
)

SKIPS = frozenset({0, 2, 3, 7, 11})
N = 12


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3)
    )


def _change(model: torch.nn.Module, step: int) -> None:
    """A real forward (moves BatchNorm's running statistics) and a parameter change."""
    gen = torch.Generator().manual_seed(step)
    model.train()
    model(torch.randn(8, 5, generator=gen))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen))


AVERAGINGS: list[tuple[str, Callable[[torch.nn.Module], AveragedModel]]] = [
    ("swa-default", AveragedModel),
    ("ema-multi", lambda m: AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9))),
    ("ema-per-tensor", lambda m: AveragedModel(m, avg_fn=get_ema_avg_fn(0.8))),
    (
        "ema-with-buffers",
        lambda m: AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True),
    ),
]


def _state(avg: AveragedModel) -> list[torch.Tensor]:
    return [*avg.module.parameters(), *avg.module.buffers(), avg.n_averaged]


@pytest.mark.parametrize("chunk", [None, 7], ids=["one-chunk", "tiny-chunks"])
@pytest.mark.parametrize(("name", "make"), AVERAGINGS, ids=[a[0] for a in AVERAGINGS])
def test_averaged_weights_equal_torch_updated_only_on_taken_steps(
    name: str,
    make: Callable[[torch.nn.Module], AveragedModel],
    chunk: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if chunk is not None:  # chunk boundaries inside and between tensors change nothing
        monkeypatch.setattr(ema_module, "_CHUNK_ELEMENTS", chunk)
    model = _model()
    ours, ref = make(model), make(model)
    for step in range(N):
        _change(model, step)  # the weights move on skipped steps too: they must be ignored
        skipped = step in SKIPS
        update_averaged_model(ours, model, skipped=torch.tensor(skipped))
        if not skipped:
            ref.update_parameters(model)
        for a, b in zip(_state(ours), _state(ref), strict=True):
            assert torch.equal(a, b), (name, step)
    assert int(ours.n_averaged) == N - len(SKIPS)


def test_a_nan_in_the_model_of_a_skipped_step_stays_out() -> None:
    model = _model()
    ours = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    update_averaged_model(ours, model, skipped=torch.tensor(False))
    before = [p.clone() for p in ours.module.parameters()]
    with torch.no_grad():
        next(model.parameters()).fill_(math.nan)
    update_averaged_model(ours, model, skipped=torch.tensor(True))
    for a, b in zip(ours.module.parameters(), before, strict=True):
        assert torch.equal(a, b)


def test_bad_input_is_refused_before_anything_changes() -> None:
    model = _model()
    avg = AveragedModel(model)
    with pytest.raises(TypeError, match="AveragedModel"):
        update_averaged_model(model, model, skipped=torch.tensor(False))  # type: ignore[arg-type]
    other = torch.nn.Linear(5, 6)
    with pytest.raises(ValueError, match="the model the AveragedModel was made from"):
        update_averaged_model(avg, other, skipped=torch.tensor(False))
    with pytest.raises(ValueError, match="no skip signal"):
        update_averaged_model(avg, model)
    assert int(avg.n_averaged) == 0


def test_a_fused_step_with_schedule_and_ema_reads_nothing_on_the_host() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = ShardedGradScaler("cpu", backend="local", init_scale=1024.0)
    sched = DeviceLRSchedule(
        opt, WarmupSchedule(steps=2, then=CosineSchedule(steps=6)), scaler=scaler
    )
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ref_ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    seen: list[list[str]] = []
    skipped: list[bool] = []
    for step in range(6):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        poison = math.inf if step in (2, 3) else 1.0
        scaler.scale(model(x).pow(2).mean() * poison).backward()
        recorder = HostReadRecorder()
        with recorder:
            scaler.step(opt)
            scaler.update()
            sched.step()
            update_averaged_model(ema, model, scaler=scaler)
        if step > 0:  # the first step checks the backend chain once, by design
            seen.append(recorder.seen)
        flag = scaler.last_step_skipped
        assert flag is not None
        skipped.append(bool(flag))
        if not skipped[-1]:
            ref_ema.update_parameters(model)
    assert seen == [[]] * 5, seen
    assert skipped == [False, False, True, True, False, False]
    assert int(sched.taken_steps) == 4
    for a, b in zip(_state(ema), _state(ref_ema), strict=True):
        assert torch.equal(a, b)


def test_the_recorder_sees_the_reads_these_helpers_avoid() -> None:
    # The probe above must not be blind: torch's own update_parameters asks the host whether
    # n_averaged == 0, and a scheduler held by reading the flag reads it.
    model = _model()
    avg = AveragedModel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    flag = torch.tensor(False)
    with HostReadRecorder() as recorder:
        avg.update_parameters(model)
    assert len(recorder.seen) >= 2, recorder.seen  # n_averaged == 0, n_averaged > 0
    with HostReadRecorder() as recorder:
        bool(flag)
    assert len(recorder.seen) == 1, recorder.seen
    # ... while the wrapper's read of the flag (a host copy) is no dispatcher read.
    held = SkipAwareScheduler(torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5))
    opt.step()  # no gradients: nothing moves; keeps torch's step-order check quiet
    with HostReadRecorder() as recorder:
        held.step(skipped=flag)
    assert recorder.seen == []


def test_any_scaler_like_source_is_accepted_and_others_refused() -> None:
    class Flagged:
        last_step_skipped: Any = torch.tensor(True)

        def is_enabled(self) -> bool:
            return True

    model = _model()
    avg = AveragedModel(model)
    update_averaged_model(avg, model, scaler=Flagged())
    assert int(avg.n_averaged) == 0
    with pytest.raises(TypeError, match="last_step_skipped"):
        update_averaged_model(avg, model, scaler=object())  # type: ignore[arg-type]
