"""Learning-rate schedules that hold on skipped steps, compared with torch's schedulers in this process.

A reference torch scheduler is stepped only on the taken steps; after N steps
of which K were skipped, ``DeviceLRSchedule`` and ``SkipAwareScheduler`` must
give the learning rate it gives after N - K steps.
"""

from __future__ import annotations

import gc
import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler as tls

from shardscale.core import ShardedGradScaler
from shardscale.schedules import (
    ConstantSchedule,
    CosineSchedule,
    DeferredStep,
    DeviceLRSchedule,
    ExponentialSchedule,
    LinearSchedule,
    LRSchedule,
    SkipAwareScheduler,
    StepSchedule,
    WarmupSchedule,
)

BASE_LRS = (0.1, 0.02)
N = 45
SKIPS = frozenset({0, 3, 4, 10, 17, 18, 19, 30, 44})  # the first step, a streak, the last step

# Tolerance. Ours: the closed form in float64 (a few roundings, ~4 units of 2**-53 relative),
# stored in float32 (one rounding, 2**-24 relative; every lr here is <= its base lr). torch's:
# most schedules update recursively in float64 on the host, a few roundings per step, so after
# n steps its error is below 16·n units of 2**-53 of the base lr (cosine's ratio form included:
# its error is relative to lr - min_lr, which is what shrinks). Hence, absolutely:
U32, U64 = 2.0**-24, 2.0**-53


def _tol(base: float, n: int) -> float:
    return base * (U32 + 16 * (n + 1) * U64)


def _groups(fused: bool = True) -> torch.optim.Optimizer:
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    groups: list[dict[str, Any]] = [
        {"params": [a], "lr": BASE_LRS[0]},
        {"params": [b], "lr": BASE_LRS[1]},
    ]
    return torch.optim.AdamW(groups, fused=fused)


def _ref_opt() -> torch.optim.Optimizer:
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD([{"params": [a], "lr": BASE_LRS[0]}, {"params": [b], "lr": BASE_LRS[1]}])


def _seq(first: Callable[[Any], Any], then: Callable[[Any], Any], at: int) -> Callable[[Any], Any]:
    return lambda o: tls.SequentialLR(o, [first(o), then(o)], milestones=[at])


CASES: list[tuple[str, LRSchedule, Callable[[Any], Any]]] = [
    ("constant", ConstantSchedule(), lambda o: tls.LambdaLR(o, lambda t: 1.0)),
    (
        "constant-factor",
        ConstantSchedule(factor=0.5, steps=4),
        lambda o: tls.ConstantLR(o, factor=0.5, total_iters=4),
    ),
    (
        "linear-warmup",
        LinearSchedule(start_factor=0.1, steps=10),
        lambda o: tls.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=10),
    ),
    (
        "linear-decay",
        LinearSchedule(start_factor=1.0, end_factor=0.05, steps=15),
        lambda o: tls.LinearLR(o, start_factor=1.0, end_factor=0.05, total_iters=15),
    ),
    (
        # 36 taken steps: past T_max, where torch's cosine rises again (its special branch too).
        "cosine",
        CosineSchedule(steps=20, min_lr=1e-3),
        lambda o: tls.CosineAnnealingLR(o, T_max=20, eta_min=1e-3),
    ),
    (
        "step",
        StepSchedule(step_size=4, gamma=0.5),
        lambda o: tls.StepLR(o, step_size=4, gamma=0.5),
    ),
    ("exponential", ExponentialSchedule(gamma=0.9), lambda o: tls.ExponentialLR(o, gamma=0.9)),
    (
        "warmup-cosine",
        WarmupSchedule(steps=5, start_factor=0.1, then=CosineSchedule(steps=25)),
        _seq(
            lambda o: tls.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=5),
            lambda o: tls.CosineAnnealingLR(o, T_max=25),
            5,
        ),
    ),
    (
        "warmup-from-zero",
        WarmupSchedule(steps=5),
        lambda o: tls.LambdaLR(o, lambda t: min(1.0, t / 5)),
    ),
    (
        "warmup-step",
        WarmupSchedule(steps=3, start_factor=0.25, then=StepSchedule(step_size=5, gamma=0.5)),
        _seq(
            lambda o: tls.LinearLR(o, start_factor=0.25, end_factor=1.0, total_iters=3),
            lambda o: tls.StepLR(o, step_size=5, gamma=0.5),
            3,
        ),
    ),
]


def _ref_step(ref_opt: torch.optim.Optimizer, ref: Any) -> None:
    ref_opt.step()  # no gradients: a no-op that keeps torch's order check quiet
    ref.step()


@pytest.mark.parametrize(("name", "schedule", "make_ref"), CASES, ids=[c[0] for c in CASES])
def test_device_schedule_equals_torch_advanced_only_on_taken_steps(
    name: str, schedule: LRSchedule, make_ref: Callable[[Any], Any]
) -> None:
    opt = _groups()
    sched = DeviceLRSchedule(opt, schedule)
    ref_opt = _ref_opt()
    ref = make_ref(ref_opt)
    taken = 0
    for step in range(-1, N):  # -1: the learning rates before any step
        if step >= 0:
            skipped = step in SKIPS
            sched.step(skipped=torch.tensor(skipped))
            if not skipped:
                _ref_step(ref_opt, ref)
                taken += 1
        assert int(sched.taken_steps) == taken
        for group, want, base in zip(opt.param_groups, ref.get_last_lr(), BASE_LRS, strict=True):
            lr = group["lr"]
            assert isinstance(lr, torch.Tensor) and lr.dtype is torch.float32
            assert abs(float(lr) - want) <= _tol(base, taken), (name, step, float(lr), want)
    assert taken == N - len(SKIPS)


def test_device_schedule_follows_the_scalers_real_overflows() -> None:
    param = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([param], lr=0.1, fused=True)
    box: dict[str, Any] = {}
    ref_opt = _ref_opt()
    ref = tls.CosineAnnealingLR(ref_opt, T_max=8)
    lrs: list[tuple[float, float]] = []

    def after(step: int) -> None:
        if step == 0:
            box["sched"] = DeviceLRSchedule(opt, CosineSchedule(steps=8), scaler=box["scaler"])
            return
        box["sched"].step()
        if step not in (5, 6):
            _ref_step(ref_opt, ref)
        lrs.append((float(opt.param_groups[0]["lr"]), ref.get_last_lr()[0]))

    scaler = ShardedGradScaler("cpu", backend="local", init_scale=64.0)
    box["scaler"] = scaler
    for step in range(12):
        opt.zero_grad()
        poison = math.inf if step in (0, 5, 6) else 1.0
        scaler.scale(param.pow(2).sum() * poison).backward()
        scaler.step(opt)
        scaler.update()
        after(step)
    assert int(box["sched"].taken_steps) == 9  # 11 steps after the first, 2 skipped
    for ours, want in lrs:
        assert abs(ours - want) <= _tol(BASE_LRS[0], 11)


def test_the_skip_signal_is_checked() -> None:
    opt = _groups()
    with pytest.raises(ValueError, match="no skip signal"):
        DeviceLRSchedule(opt, ConstantSchedule()).step()
    scaler = ShardedGradScaler("cpu", backend="local")
    sched = DeviceLRSchedule(_groups(), ConstantSchedule(), scaler=scaler)
    with pytest.raises(RuntimeError, match=r"call scaler.update\(\)"):
        sched.step()  # before any update(): the flag of which step?
    with pytest.raises(ValueError, match="one element"):
        sched.step(skipped=torch.zeros(2, dtype=torch.bool))
    with pytest.raises(TypeError, match="one-element tensor"):
        sched.step(skipped=True)  # type: ignore[arg-type]
    assert int(sched.taken_steps) == 0  # nothing advanced on any refusal
    # A disabled scaler never skips.
    off = DeviceLRSchedule(_groups(), ConstantSchedule(), scaler=ShardedGradScaler(enabled=False))
    off.step()
    off.step()
    assert int(off.taken_steps) == 2


def test_one_update_feeds_one_step() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1, fused=True)
    scaler = ShardedGradScaler("cpu", backend="local")
    sched = DeviceLRSchedule(opt, ExponentialSchedule(gamma=0.5), scaler=scaler)
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    with pytest.raises(RuntimeError, match="no new skip flag"):
        sched.step()  # a second step() for the same update would count the step twice
    assert int(sched.taken_steps) == 1


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True), "fused=True"),
        (lambda ps: torch.optim.Adam(ps, lr=0.1), "fused=True"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False), "fused=True"),
        (lambda ps: torch.optim.RMSprop(ps, lr=0.1), "SkipAwareScheduler"),
    ],
    ids=["adamw-foreach", "adam-default", "sgd-for-loop", "rmsprop"],
)
def test_optimizers_that_read_a_tensor_lr_on_the_host_are_refused(
    make: Callable[[Any], torch.optim.Optimizer], match: str
) -> None:
    opt = make([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises((ValueError, TypeError), match=match):
        DeviceLRSchedule(opt, ConstantSchedule())
    assert opt.param_groups[0]["lr"] == 0.1 and "initial_lr" not in opt.param_groups[0]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: LinearSchedule(start_factor=1.5, steps=3), r"start_factor=1.5"),
        (lambda: CosineSchedule(steps=0), r"steps=...\) takes an int >= 1"),
        (lambda: StepSchedule(step_size=2, gamma=math.nan), "gamma=nan"),
        (lambda: WarmupSchedule(steps=2, then=tls.StepLR), "then="),  # type: ignore[arg-type]
    ],
)
def test_bad_schedules_are_refused(make: Callable[[], Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_state_dict_round_trip_and_bad_state() -> None:
    schedule = WarmupSchedule(steps=3, then=ExponentialSchedule(gamma=0.8))
    sched = DeviceLRSchedule(_groups(), schedule)
    for step in range(7):
        sched.step(skipped=torch.tensor(step == 2))
    state = sched.state_dict()
    assert state == {"taken_steps": 6, "base_lrs": list(BASE_LRS)}
    fresh_opt = _groups()
    fresh = DeviceLRSchedule(fresh_opt, schedule)
    with pytest.raises(ValueError, match="one learning rate per param group"):
        fresh.load_state_dict({"taken_steps": 6, "base_lrs": [0.1]})
    assert int(fresh.taken_steps) == 0  # refused whole
    fresh.load_state_dict(state)
    assert [float(lr) for lr in fresh.get_last_lr()] == [float(lr) for lr in sched.get_last_lr()]
    assert [float(g["lr"]) for g in fresh_opt.param_groups] == [
        float(lr) for lr in sched.get_last_lr()
    ]


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def test_the_schedule_survives_loading_an_optimizer_checkpoint() -> None:
    opt = _groups()
    sched = DeviceLRSchedule(opt, ExponentialSchedule(gamma=0.5))
    saved = opt.state_dict()
    sched.step(skipped=torch.tensor(False))
    opt.load_state_dict(saved)  # new param-group dicts holding the saved lr
    sched.step(skipped=torch.tensor(False))
    # Powers of two: the float32 results are exact roundings of base / 4.
    assert [float(g["lr"]) for g in opt.param_groups] == [_f32(b / 4) for b in BASE_LRS]


def test_a_float32_lr_tensor_of_the_users_is_kept() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=torch.tensor(0.1), fused=True)
    mine = opt.param_groups[0]["lr"]
    sched = DeviceLRSchedule(opt, ExponentialSchedule(gamma=0.5))
    sched.step(skipped=torch.tensor(False))
    assert opt.param_groups[0]["lr"] is mine and float(mine) == _f32(_f32(0.1) / 2)


# -- the generic wrapper ---------------------------------------------------------------------


def _one_cycle(o: torch.optim.Optimizer) -> Any:
    return tls.OneCycleLR(o, max_lr=0.5, total_steps=N + 5)


WRAPPED: list[tuple[str, Callable[[Any], Any]]] = [
    ("cosine", lambda o: tls.CosineAnnealingLR(o, T_max=20)),
    (
        "sequential",
        _seq(
            lambda o: tls.LinearLR(o, start_factor=0.1, total_iters=5),
            lambda o: tls.ExponentialLR(o, gamma=0.95),
            5,
        ),
    ),
    ("one-cycle", _one_cycle),  # also moves momentum: every group key follows
]


@pytest.mark.parametrize(("name", "make"), WRAPPED, ids=[w[0] for w in WRAPPED])
def test_wrapped_scheduler_advances_only_on_taken_steps(
    name: str, make: Callable[[Any], Any]
) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    held = SkipAwareScheduler(make(opt))
    ref = make(ref_opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's order check: no real steps here
        for step in range(N):
            opt.step()  # the group values the optimizer steps with, after any deferred decision
            assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
            assert opt.param_groups[0]["momentum"] == ref_opt.param_groups[0]["momentum"]
            skipped = step in SKIPS
            held.step(skipped=torch.tensor(skipped))
            if not skipped:
                ref.step()
    # Same float arithmetic in the same order: equal, not close.
    assert held.get_last_lr() == ref.get_last_lr()
    assert held.last_epoch == ref.last_epoch == N - len(SKIPS)
    assert held.state_dict() == ref.state_dict()


def test_wrapped_scheduler_with_a_scaler_and_an_unfused_optimizer() -> None:
    # The unfused step skips the optimizer entirely on an overflow: the decision still lands.
    param = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([param], lr=0.1)
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(4))], lr=0.1)
    box: dict[str, Any] = {}
    ref = tls.StepLR(ref_opt, step_size=2, gamma=0.5)

    def after(step: int) -> None:
        if step == 0:
            box["held"] = SkipAwareScheduler(
                tls.StepLR(opt, step_size=2, gamma=0.5), scaler=box["scaler"]
            )
            return
        box["held"].step()
        if step not in (5, 6):
            ref_opt.step()
            ref.step()

    box["scaler"] = scaler = ShardedGradScaler("cpu", backend="local", init_scale=64.0)
    for step in range(12):
        opt.zero_grad()
        poison = math.inf if step in (0, 5, 6) else 1.0
        scaler.scale(param.pow(2).sum() * poison).backward()
        scaler.step(opt)
        scaler.update()
        after(step)
    assert box["held"].last_epoch == ref.last_epoch == 9
    assert box["held"].get_last_lr() == ref.get_last_lr()


def test_deferred_step_runs_only_for_a_taken_step_and_lets_go_of_the_optimizer() -> None:
    # The deferral the Lightning and Accelerate integrations hold schedulers with.
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    calls: list[tuple[Any, ...]] = []
    deferred = DeferredStep(opt, lambda *a, **k: calls.append((a, k)))
    deferred.submit(torch.tensor(True), (1,), {})
    deferred.submit(torch.tensor(False), (2,), {"metric": 0.5})
    deferred.submit(torch.tensor(3.0) != 0, (3,), {})  # any 0-dim bool flag
    deferred.settle()  # nothing pending off a GPU: the copy landed at submit
    assert calls == [((2,), {"metric": 0.5})] and not deferred.pending
    deferred.drop()
    deferred.remove()
    opt.step()  # the hook is gone
    assert calls == [((2,), {"metric": 0.5})]
    # The optimizer's hook holds the deferral weakly: it dies with its owner, the optimizer
    # still steps.
    gone = DeferredStep(opt, lambda *a, **k: None)
    ref = weakref.ref(gone)
    del gone
    gc.collect()
    assert ref() is None
    opt.step()


def test_the_wrapper_refuses_what_is_not_a_torch_scheduler() -> None:
    with pytest.raises(TypeError, match="LRScheduler"):
        SkipAwareScheduler(object())  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the deferred host read needs a GPU")
def test_wrapped_scheduler_defers_on_a_gpu_and_settles_before_the_optimizer_step() -> None:
    param = torch.nn.Parameter(torch.zeros(1 << 20, device="cuda"))
    opt = torch.optim.AdamW([param], lr=0.1, fused=True)
    ref_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    held = SkipAwareScheduler(tls.ExponentialLR(opt, gamma=0.5))
    ref = tls.ExponentialLR(ref_opt, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for step in range(6):
            param.grad = torch.ones_like(param)
            opt.step()
            assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
            skipped = torch.tensor(step % 2 == 1, device="cuda")
            held.step(skipped=skipped)
            if step % 2 == 0:
                ref.step()
    assert held.get_last_lr() == ref.get_last_lr()
