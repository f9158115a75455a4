"""The step verdict in one process: no loss scaling, spikes, the loss, streaks, reasons, checkpoints.

Every expected decision comes from a rule written here (the spike test with
Python's ``statistics``), never from shardscale's code; optimizers are compared
with torch's own run that steps only on the steps the rule takes. Multi-rank
agreement is in ``integration_tests/test_verdict.py``; schedules and averaged
weights that follow the verdict, in shardscale-schedules' tests.
"""

from __future__ import annotations

import math
import pickle
import statistics
from typing import Any

import pytest
import torch

from shardscale.core import (
    ScalerStateError,
    ShardedGradScaler,
    SkipReason,
    SkipStreakError,
    SpikeSkip,
    StepRecord,
)
from shardscale.core.testing import recording_steps


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(5, 3, generator=gen)),
        torch.nn.Parameter(torch.randn(4, generator=gen)),
    ]


def _grads(step: int, factor: float = 1.0) -> list[torch.Tensor]:
    """This step's gradients (the same for ours and the reference), times ``factor``."""
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(5, 3, generator=gen) * factor, torch.randn(4, generator=gen) * factor]


def _norm(grads: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads))


def reference_is_spike(norm: float, accepted: list[float], policy: dict[str, Any]) -> bool:
    """The spike rule as documented, on Python floats (not shardscale's code)."""
    if not math.isfinite(norm):
        return False
    if policy.get("max_norm_abs") is not None and norm > policy["max_norm_abs"]:
        return True
    if len(accepted) < policy["warmup"]:
        return False
    recent = accepted[-policy["window"] :]
    mean = statistics.fmean(recent)
    if policy.get("z") is not None and norm > mean + policy["z"] * statistics.stdev(recent):
        return True
    return policy.get("ratio") is not None and norm > policy["ratio"] * mean


# -- loss_scaling=False --------------------------------------------------------------------------


def test_without_loss_scaling_the_scale_is_one_and_a_nan_skips_like_an_overflow() -> None:
    ours, ref = _params(), _params()
    opt = torch.optim.AdamW(ours, lr=0.1, fused=True)
    ref_opt = torch.optim.AdamW(ref, lr=0.1)
    scaler = ShardedGradScaler("cpu", loss_scaling=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss  # unchanged, not even multiplied by 1
    skipped, reasons = [], []
    for step in range(6):
        grads = _grads(step)
        if step in (2, 3):
            grads[1][0] = math.nan if step == 2 else math.inf
        for p, g in zip(ours, grads, strict=True):
            p.grad = g.clone()
        scaler.step(opt)
        scaler.update()
        skipped.append(bool(scaler.last_step_skipped))
        reasons.append(SkipReason(int(scaler.last_skip_reason)))  # type: ignore[arg-type]
        if math.isfinite(_norm(grads)):  # the reference steps on finite gradients only
            for p, g in zip(ref, grads, strict=True):
                p.grad = g.clone()
            ref_opt.step()
    assert skipped == [False, False, True, True, False, False]
    assert reasons == [SkipReason.NONFINITE if s else SkipReason.NONE for s in skipped]
    # Neither grown nor backed off, and the growth tracker never moved.
    assert scaler.get_scale() == 1.0 and scaler.state_dict()["_growth_tracker"] == 0
    # fused AdamW (ours) vs for-loop AdamW (reference): the same arithmetic up to rounding
    # of a few float32 operations per step (6 steps, lr 0.1): 1e-6 relative.
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"init_scale": 1024.0}, "init_scale=1024.0"),
        ({"growth_interval": 10}, "growth_interval=10"),
        ({"hysteresis": 2, "max_scale": 8.0}, "hysteresis=2, max_scale=8.0"),
    ],
)
def test_scaling_options_contradicting_a_fixed_scale_are_refused(
    kwargs: dict[str, Any], named: str
) -> None:
    with pytest.raises(ScalerStateError, match="loss_scaling=False fixes the scale at 1") as info:
        ShardedGradScaler("cpu", loss_scaling=False, **kwargs)
    assert named in str(info.value)
    ShardedGradScaler("cpu", loss_scaling=False, init_scale=1.0)  # the fixed scale itself is fine
    with pytest.raises(TypeError, match="loss_scaling must be True"):
        ShardedGradScaler("cpu", loss_scaling="no")  # type: ignore[arg-type]


def test_a_fixed_scale_refuses_update_new_scale_and_other_precision_checkpoints() -> None:
    scaler = ShardedGradScaler("cpu", loss_scaling=False)
    scaler.scale(torch.tensor(1.0))
    with pytest.raises(ScalerStateError, match="fixed at 1"):
        scaler.update(new_scale=2.0)
    fp16 = ShardedGradScaler("cpu").state_dict()
    with pytest.raises(ScalerStateError, match="loss_scaling=True"):
        scaler.load_state_dict(fp16)
    with pytest.raises(ScalerStateError, match="loss_scaling=False"):
        ShardedGradScaler("cpu").load_state_dict(scaler.state_dict())
    assert scaler.get_scale() == 1.0


# -- SpikeSkip -----------------------------------------------------------------------------------


def test_spike_skip_defaults_and_refusals() -> None:
    assert SpikeSkip() == SpikeSkip(max_norm_abs=None, z=6.0, ratio=None, window=128)
    # OLMo-core tests the 64th value (index 63) against the 63 before it: 63 accepted norms.
    assert SpikeSkip().armed_after == 63 and SpikeSkip(window=8).armed_after == 3
    with pytest.raises(TypeError):
        SpikeSkip(5.0)  # type: ignore[misc]  # keyword-only
    with pytest.raises(ValueError, match="tests nothing"):
        SpikeSkip(z=None)
    with pytest.raises(ValueError, match="window"):
        SpikeSkip(window=1)
    with pytest.raises(ValueError, match="warmup"):
        SpikeSkip(warmup=1)  # a std needs two norms
    with pytest.raises(ValueError, match="ratio"):
        SpikeSkip(ratio=0.5)
    with pytest.raises(ValueError, match="max_norm_abs"):
        SpikeSkip(max_norm_abs=-1.0)
    with pytest.raises(TypeError, match="spike takes a SpikeSkip"):
        ShardedGradScaler("cpu", spike=6.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        ShardedGradScaler("cpu", max_consecutive_skips=0)


SPIKES = {5: 50.0, 9: 1e3, 10: 40.0}  # step -> gradient factor


@pytest.mark.parametrize(
    "policy",
    [
        {"z": 3.0, "window": 4, "warmup": 3},
        {"z": None, "ratio": 2.5, "window": 6, "warmup": 2},
        {"z": None, "max_norm_abs": 30.0, "window": 4, "warmup": 2},
    ],
    ids=["z", "ratio", "absolute"],
)
@pytest.mark.parametrize("clip", [False, True], ids=["step-alone", "unscale_and_clip"])
def test_spike_decisions_and_weights_equal_a_reference_that_steps_on_taken_steps_only(
    policy: dict[str, Any], clip: bool
) -> None:
    ours, ref = _params(), _params()
    opt = torch.optim.SGD(ours, lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref, lr=0.05, momentum=0.9)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8, spike=SpikeSkip(**policy))
    accepted: list[float] = []
    expected, got, norms = [], [], []
    for step in range(14):
        grads = _grads(step, SPIKES.get(step, 1.0))
        norm = _norm(grads)
        spike = reference_is_spike(norm, accepted, policy)
        expected.append(spike)
        if not spike:
            accepted.append(norm)
            for p, g in zip(ref, grads, strict=True):
                p.grad = g.clone()
            if clip:
                torch.nn.utils.clip_grad_norm_(ref, 4.0)
            ref_opt.step()
        for p, g in zip(ours, grads, strict=True):
            p.grad = g * scaler.get_scale()  # what backward of a scaled loss gives
        if clip:
            norms.append(float(scaler.unscale_(opt, max_norm=4.0)))  # type: ignore[arg-type]
        scaler.step(opt)
        scaler.update()
        got.append(bool(scaler.last_step_skipped))
        reason = SkipReason(int(scaler.last_skip_reason))  # type: ignore[arg-type]
        assert reason is (SkipReason.SPIKE if got[-1] else SkipReason.NONE)
    assert got == expected
    assert sum(expected) >= 2, "the case must really skip"
    # The pre-clip norm is the one tested: 19 values summed in float32, so at most
    # (19 + 8) * 2u + u relative error (u = 2**-24; see integration_tests/tolerances.py).
    rtol = 55 * 2.0**-24
    for step, ours_norm in enumerate(norms):
        exact = _norm(_grads(step, SPIKES.get(step, 1.0)))
        assert abs(ours_norm - exact) <= rtol * exact
    # A spike is no overflow: the scale never backed off (growth_interval 2000: no growth).
    assert scaler.get_scale() == 2.0**8
    # Unscaling by a power of two is exact; clipping and SGD in float32: rounding only.
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6)
    window = scaler.state_dict()["spike_window"]
    assert window == pytest.approx(accepted[-policy["window"] :], rel=1e-6)


@pytest.mark.parametrize(
    "policy",
    [
        {"z": 6.0, "window": 16, "warmup": 5},  # armed while the window fills
        {"z": 2.0, "ratio": 1.5, "window": 8, "warmup": 2},
        {"z": 3.0, "max_norm_abs": 9.0, "window": 4, "warmup": 6},  # armed only once full
    ],
)
def test_the_threshold_through_the_window_filling_equals_the_reference(
    policy: dict[str, Any],
) -> None:
    """Norms just below and just above the documented threshold, at every count from empty
    to a full and turning window: the window's statistics (one var_mean and coefficients per
    count) match statistics.fmean/stdev of the held norms to within their rounding."""
    from shardscale.core.step._verdict import SpikeWindow

    window = SpikeWindow(SpikeSkip(**policy))
    window.materialize(torch.device("cpu"))
    gen = torch.Generator().manual_seed(7)
    # Norms near 3 with a small spread: the spread is what a partial window's arithmetic
    # could lose to cancellation, so a 1e-6 relative margin around the threshold tests it.
    norms = (3.0 + 0.05 * torch.randn(3 * policy["window"], generator=gen)).tolist()
    accepted: list[float] = []
    taken = torch.tensor(int(SkipReason.NONE))
    for norm in norms:
        for factor, offset in ((1.0, -1e-6), (1.0, 1e-6)):
            probe = _reference_threshold(accepted, policy) * (factor + offset)
            if not math.isfinite(probe):
                probe = 1e30  # unarmed: not even a huge norm is a spike (no max_norm_abs)
            want = reference_is_spike(probe, accepted, policy)
            got = bool(window.is_spike(torch.tensor(probe, dtype=torch.float64)))
            assert got is want, (len(accepted), probe, policy)
        window.is_spike(torch.tensor(norm, dtype=torch.float64))
        window.accept(taken)
        accepted.append(norm)
    held, count = window.state()
    assert count == len(norms)
    assert held == pytest.approx(accepted[-policy["window"] :], rel=0, abs=0)


def _reference_threshold(accepted: list[float], policy: dict[str, Any]) -> float:
    """The smallest norm the reference calls a spike (inf when no test is armed)."""
    limits = [policy["max_norm_abs"]] if policy.get("max_norm_abs") is not None else []
    if len(accepted) >= policy["warmup"]:
        recent = accepted[-policy["window"] :]
        mean = statistics.fmean(recent)
        if policy.get("z") is not None:
            limits.append(mean + policy["z"] * statistics.stdev(recent))
        if policy.get("ratio") is not None:
            limits.append(policy["ratio"] * mean)
    return min(limits, default=math.inf)


def test_a_spike_counts_for_growth_as_a_clean_step() -> None:
    (p,) = _params()[:1]
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = ShardedGradScaler(
        "cpu", init_scale=4.0, growth_interval=3, spike=SpikeSkip(max_norm_abs=10.0, z=None)
    )
    skipped = []
    for step in range(3):
        p.grad = torch.full_like(p, 100.0 if step == 1 else 0.1) * scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(bool(scaler.last_step_skipped))
    assert skipped == [False, True, False]
    assert scaler.get_scale() == 8.0  # three finite steps: grown once, never backed off


# -- the loss ------------------------------------------------------------------------------------


@pytest.mark.parametrize("check_loss", [False, True])
def test_a_non_finite_loss_with_finite_gradients_skips_only_when_checked(check_loss: bool) -> None:
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", check_loss=check_loss)
    before = [p.detach().clone() for p in model.parameters()]
    # The inf term does not depend on the parameters: its gradient is zero, the loss inf.
    loss = model(torch.ones(2, 3)).sum() + torch.tensor(math.inf)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert bool(scaler.last_step_skipped) is check_loss
    moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert moved is not check_loss
    want = SkipReason.LOSS if check_loss else SkipReason.NONE
    assert int(scaler.last_skip_reason) == want  # type: ignore[arg-type]
    assert scaler.get_scale() == 2.0**16  # a loss skip does not back off
    # The flag lasts one iteration.
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert not bool(scaler.last_step_skipped)


def test_reasons_follow_their_precedence() -> None:
    (p,) = _params()[:1]
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = ShardedGradScaler("cpu", loss_scaling=False, spike=SpikeSkip(max_norm_abs=1.0, z=None))
    cases = [  # (gradient value, loss) -> the expected reason
        (10.0, 1.0, SkipReason.SPIKE),
        (10.0, math.nan, SkipReason.LOSS),  # a loss beats a spike
        (math.inf, math.nan, SkipReason.NONFINITE),  # a non-finite gradient beats the loss
        (0.01, 1.0, SkipReason.NONE),
    ]
    for value, loss, want in cases:
        scaler.observe_loss(torch.tensor(loss))
        p.grad = torch.full_like(p, value)
        scaler.step(opt)
        scaler.update()
        assert int(scaler.last_skip_reason) == want, (value, loss)  # type: ignore[arg-type]
        assert bool(scaler.last_step_skipped) is (want is not SkipReason.NONE)


# -- streaks -------------------------------------------------------------------------------------


def test_a_streak_of_skips_raises_at_the_update_that_reaches_the_limit() -> None:
    (p,) = _params()[:1]
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = ShardedGradScaler(
        "cpu", loss_scaling=False, max_consecutive_skips=3, spike=SpikeSkip(max_norm_abs=5.0)
    )
    bad = {1: math.nan, 2: 50.0, 4: math.inf, 5: 50.0}  # steps 1-2 and 4-5: streaks of 2
    bad.update({6: math.nan})  # 4, 5, 6: the third in a row
    raised_at = None
    for step in range(8):
        p.grad = torch.full_like(p, bad.get(step, 0.1))
        scaler.step(opt)
        try:
            scaler.update()
        except SkipStreakError as exc:
            raised_at = step
            assert exc.step == 7 and exc.streak == 3  # scaler steps are counted from 1
            assert exc.reasons == (SkipReason.SPIKE, SkipReason.NONFINITE)
            assert "steps 5 to 7" in str(exc) and "spike, nonfinite" in str(exc)
            break
    assert raised_at == 6
    assert scaler.state_dict()["_skip_streak"] == 3  # the state is complete when it raises


# -- checkpoints ---------------------------------------------------------------------------------


def _train(scaler: ShardedGradScaler, steps: range) -> list[bool]:
    (p,) = _params()[:1]
    opt = torch.optim.SGD([p], lr=0.0)
    out = []
    for step in steps:
        p.grad = torch.full_like(p, SPIKES.get(step, 1.0 + 0.01 * step))
        scaler.step(opt)
        scaler.update()
        out.append(bool(scaler.last_step_skipped))
    return out


def test_the_window_after_resume_equals_the_uninterrupted_runs() -> None:
    policy = SpikeSkip(window=4, warmup=3, z=3.0)
    whole = ShardedGradScaler("cpu", loss_scaling=False, spike=policy)
    uninterrupted = _train(whole, range(12))
    head = ShardedGradScaler("cpu", loss_scaling=False, spike=policy)
    first = _train(head, range(7))
    saved = head.state_dict()
    # torch.save/torch.load(weights_only=True) and a pickle of the scaler both keep it.
    resumed = ShardedGradScaler("cpu", loss_scaling=False, spike=policy)
    resumed.load_state_dict(saved)  # before any step: the window waits on the host
    copied = pickle.loads(pickle.dumps(head))
    assert first + _train(resumed, range(7, 12)) == uninterrupted
    assert _train(copied, range(7, 12)) == uninterrupted[7:]
    assert True in uninterrupted  # the spike at step 9 is skipped in every run
    for other in (resumed, copied):
        assert other.state_dict() == whole.state_dict()


def test_a_bad_window_in_a_checkpoint_changes_nothing() -> None:
    scaler = ShardedGradScaler("cpu", spike=SpikeSkip(window=4, warmup=2))
    _train(scaler, range(3))
    before = scaler.state_dict()
    for bad in ({"spike_window": [1.0, math.nan]}, {"spike_window": [1.0], "spike_accepted": 0}):
        with pytest.raises(ScalerStateError, match="spike_"):
            scaler.load_state_dict({**before, **bad})
        assert scaler.state_dict() == before


# -- the skip signal -----------------------------------------------------------------------------


def test_update_with_new_scale_publishes_a_fresh_verdict() -> None:
    (p,) = _params()[:1]
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = ShardedGradScaler("cpu")
    flags = []
    for value in (math.inf, 0.1):
        p.grad = torch.full_like(p, value)
        scaler.step(opt)
        scaler.update(new_scale=1024.0)
        flags.append(scaler.last_step_skipped)
    assert [bool(f) for f in flags] == [True, False]  # type: ignore[arg-type]
    assert flags[0] is not flags[1]  # a new flag each update: consumers see a new step
    assert scaler.get_scale() == 1024.0


def test_step_records_carry_the_reason() -> None:
    (p,) = _params()[:1]
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = ShardedGradScaler("cpu", spike=SpikeSkip(max_norm_abs=5.0, z=None))
    records: list[StepRecord]
    with recording_steps() as rec:
        for value in (0.1, 50.0, math.inf):
            p.grad = torch.full_like(p, value) * scaler.get_scale()
            scaler.step(opt)
            scaler.update()
        records = rec.records
    assert [int(r.skip_reason) for r in records] == [0, 1, 4]  # type: ignore[arg-type]
    assert [bool(r.skipped) for r in records] == [False, True, True]
    assert [bool(r.found_inf) for r in records] == [False, False, True]  # only the overflow


def test_several_optimizers_under_spike_are_refused_before_the_second_step() -> None:
    a, b = _params()
    opts = [torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)]
    scaler = ShardedGradScaler("cpu", spike=SpikeSkip())
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    scaler.step(opts[0])
    before = b.detach().clone()
    with pytest.raises(ValueError, match="one global norm per iteration"):
        scaler.step(opts[1])
    assert torch.equal(b.detach(), before)


def test_a_scaler_pickled_before_the_verdict_unpickles_as_torchs() -> None:
    scaler = ShardedGradScaler("cpu", init_scale=8.0)
    state = scaler.__getstate__()
    for name in ("_loss_scaling", "_check_loss", "_spike", "_spike_window", "_streak"):
        del state[name]  # what an older version pickled
    old = ShardedGradScaler.__new__(ShardedGradScaler)
    old.__setstate__(state)
    (p,) = _params()[:1]
    p.grad = torch.full_like(p, math.inf)
    old.step(torch.optim.SGD([p], lr=0.1))
    old.update()
    assert int(old.last_skip_reason) == SkipReason.OVERFLOW  # type: ignore[arg-type]
    assert old.get_scale() == 4.0 and old.loss_scaling and old.spike is None


def _one_value_training(scaler: ShardedGradScaler, norms: list[float]) -> list[bool]:
    """Steps whose global norm is each of ``norms`` (a one-element parameter); skipped or not."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    out = []
    for norm in norms:
        p.grad = torch.full_like(p, norm)
        scaler.step(opt)
        scaler.update()
        out.append(bool(scaler.last_step_skipped))
    return out


@pytest.mark.parametrize(
    "larger",
    [SpikeSkip(window=8, warmup=3, ratio=2.0, z=None), SpikeSkip(window=8, warmup=3, z=3.0)],
    ids=["ratio", "z"],
)
def test_a_window_resumed_into_a_larger_one_holds_only_the_saved_norms(larger: SpikeSkip) -> None:
    steady = [1.0, 1.1, 0.9, 1.0, 1.1, 0.9, 1.0, 1.1]  # 8 accepted norms; the window keeps 4
    head = ShardedGradScaler("cpu", loss_scaling=False, spike=SpikeSkip(window=4, warmup=3))
    assert _one_value_training(head, steady) == [False] * len(steady)
    saved = head.state_dict()
    resumed = ShardedGradScaler("cpu", loss_scaling=False, spike=larger)
    resumed.load_state_dict(saved)
    kept = saved["spike_window"]
    assert resumed.state_dict()["spike_window"] == kept  # exactly the accepted norms
    assert resumed.state_dict()["spike_accepted"] == len(kept)
    # The reference: a window of exactly those norms, tested as the docs say (one-sided).
    mean, std = statistics.mean(kept), statistics.stdev(kept)
    limit = 2.0 * mean if larger.ratio is not None else mean + 3.0 * std
    # Counting the 4 empty slots as accepted zeros halved the mean (ratio: 1.05 skipped for
    # good) and widened the spread (z: a 3x spike taken).
    normal, spike = 1.05, 3.0 * mean
    assert normal < limit < spike
    assert _one_value_training(resumed, [normal, spike, normal]) == [False, True, False]


def test_a_streak_after_a_resume_names_the_real_step_numbers() -> None:
    head = ShardedGradScaler("cpu", loss_scaling=False, max_consecutive_skips=3)
    # Steps 1-5 taken, 6-7 skipped (non-finite): a streak of 2 at the checkpoint.
    assert _one_value_training(head, [1.0] * 5 + [math.nan] * 2) == [False] * 5 + [True] * 2
    resumed = ShardedGradScaler("cpu", loss_scaling=False, max_consecutive_skips=3)
    resumed.load_state_dict(head.state_dict())
    with pytest.raises(SkipStreakError) as caught:
        _one_value_training(resumed, [math.inf])
    assert caught.value.step == 8 and caught.value.streak == 3
    assert "scaler steps 6 to 8" in str(caught.value)


def _olmo_core_skips(norms: list[float], *, length: int = 128, sigma: float = 6.0) -> list[bool]:
    """OLMo-core's SkipStepOptimizer rule on grad norms, written from its documented behaviour:
    the history keeps the last ``length + 1`` values (the current one last); a value is tested
    once the history holds ``max(2, length // 2)``, one-sided against the mean and unbiased std
    of the values before it; skipped steps stay in its history."""
    history: list[float] = []
    out = []
    for norm in norms:
        history = [*history, norm][-(length + 1) :]
        if len(history) < max(2, length // 2):
            out.append(False)
            continue
        before = history[:-1]
        mean, std = statistics.mean(before), statistics.stdev(before)
        out.append(norm - mean > sigma * std)
    return out


@pytest.mark.parametrize("spike_at", [62, 63, 64, 90])
def test_spike_skip_default_takes_olmo_cores_decisions_from_the_first_tested_step(
    spike_at: int,
) -> None:
    gen = torch.Generator().manual_seed(spike_at)
    norms = (1.0 + 0.05 * torch.randn(100, generator=gen, dtype=torch.float64)).tolist()
    norms[spike_at] = 5.0  # ~80 sigma: a spike wherever it is tested
    expected = _olmo_core_skips(norms[: spike_at + 1])
    # Index 63 is the first step OLMo-core tests (64 values with it): skipped there, taken at 62.
    assert expected[-1] is (spike_at >= 63)
    ours = _one_value_training(
        ShardedGradScaler("cpu", loss_scaling=False, spike=SpikeSkip()), norms[: spike_at + 1]
    )
    assert ours == expected
