"""The scaler's option objects (issue 27): torch's seven arguments plus six keyword options.

What the constructor looks like (compared with torch's own signatures), the
keywords that moved and the error each gives, and each option object: frozen,
self-validating with bounded ranges, equal by value, and stable in what it
declares to the other ranks. Ranks that disagree are in
``integration_tests/test_declarations.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import time
from typing import Any

import pytest
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as FSDP1Scaler

from shardscale.core import (
    Layout,
    LossCheck,
    ScaleBounds,
    ScalerStateError,
    ShardedGradScaler,
    SkipReason,
    SkipStreakError,
    SkipStreakLimit,
    SpikeSkip,
)

_TORCH_SEVEN = [
    "device",
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "enabled",
    "process_group",
]
_OPTIONS = ["backend", "kernels", "layout", "policies", "loss_scaling", "fuse_optimizer"]


def test_the_signature_is_torchs_seven_and_six_keyword_options() -> None:
    params = inspect.signature(ShardedGradScaler).parameters
    assert len(params) <= 13
    assert list(params) == _TORCH_SEVEN + _OPTIONS
    positional = [p for p in params.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == _TORCH_SEVEN
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in _OPTIONS)
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
    # torch.amp.GradScaler's six, in its order and with its defaults: a positional drop-in.
    theirs = inspect.signature(torch.amp.GradScaler).parameters
    assert list(theirs) == _TORCH_SEVEN[:6]
    for name, param in theirs.items():
        assert params[name].default == param.default, name
    # FSDP1's seventh, process_group, with its default (FSDP1 orders the factors by keyword).
    fsdp1 = inspect.signature(FSDP1Scaler).parameters
    assert set(fsdp1) == set(_TORCH_SEVEN)
    assert params["process_group"].default is fsdp1["process_group"].default is None


_MOVED: list[tuple[str, Any, str]] = [
    ("hysteresis", 3, r"loss_scaling=ScaleBounds\(hysteresis=3\)"),
    ("min_scale", 2.0, r"loss_scaling=ScaleBounds\(min_scale=2\.0\)"),
    ("max_scale", 2.0**20, r"loss_scaling=ScaleBounds\(max_scale=1048576\.0\)"),
    ("distinct_dims", ("pp",), r"layout=Layout\(distinct_dims=\('pp',\)\)"),
    ("distinct_params", [torch.ones(1)], r"layout=Layout\(distinct_params=\[\.\.\.\]\)"),
    ("spike", SpikeSkip(window=8), r"policies=\[SpikeSkip\(.*window=8"),
    ("check_loss", True, r"policies=\[LossCheck\(\)\]"),
    ("max_consecutive_skips", 4, r"policies=\[SkipStreakLimit\(max_skips=4\)\]"),
    ("registry", None, r"process registry.*get_registry\(\)\.register"),
]


@pytest.mark.parametrize(("name", "value", "fix"), _MOVED, ids=[m[0] for m in _MOVED])
def test_each_moved_keyword_names_its_replacement(name: str, value: Any, fix: str) -> None:
    with pytest.raises(TypeError, match=rf"ShardedGradScaler\(\): .*{name}= .*{fix}"):
        ShardedGradScaler("cpu", **{name: value})


def test_several_moved_keywords_are_named_together_and_asking_for_nothing_says_drop_it() -> None:
    with pytest.raises(TypeError) as info:
        ShardedGradScaler(
            "cpu",
            spike=SpikeSkip(),  # type: ignore[call-arg]
            max_consecutive_skips=2,
            hysteresis=2,
            min_scale=1.0,
        )
    text = str(info.value)
    assert "policies=[SpikeSkip(" in text and "SkipStreakLimit(max_skips=2)]" in text
    assert "loss_scaling=ScaleBounds(hysteresis=2, min_scale=1.0)" in text
    with pytest.raises(TypeError, match="drop it"):
        ShardedGradScaler("cpu", check_loss=False)  # type: ignore[call-arg]
    # The replacement the message names builds the scaler.
    built = ShardedGradScaler(
        "cpu",
        policies=[SpikeSkip(), SkipStreakLimit(max_skips=2)],
        loss_scaling=ScaleBounds(hysteresis=2, min_scale=1.0),
    )
    assert built.get_hysteresis() == 2
    # A keyword no version had is Python's own error.
    with pytest.raises(TypeError, match="unexpected keyword argument 'spikes'"):
        ShardedGradScaler("cpu", spikes=[SpikeSkip()])  # type: ignore[call-arg]


# -- the option objects --------------------------------------------------------------------------

_OBJECTS = [
    ScaleBounds(hysteresis=2, min_scale=1.0),
    Layout(distinct_dims=("pp",)),
    LossCheck(),
    SkipStreakLimit(max_skips=3),
    SpikeSkip(window=8),
]


@pytest.mark.parametrize("option", _OBJECTS, ids=lambda o: type(o).__name__)
def test_each_option_object_is_frozen_and_survives_pickle(option: Any) -> None:
    for field in dataclasses.fields(option):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(option, field.name, getattr(option, field.name))
    assert pickle.loads(pickle.dumps(option)) == option
    assert hash(copy.deepcopy(option)) == hash(option)


@pytest.mark.parametrize(
    ("build", "error", "problem"),
    [
        (lambda: ScaleBounds(hysteresis=0), ScalerStateError, r"hysteresis.*>= 1.*got 0"),
        (lambda: ScaleBounds(hysteresis=2**31), ScalerStateError, r"<= 2147483647"),
        (lambda: ScaleBounds(hysteresis=1.5), ScalerStateError, r"hysteresis.*got 1\.5"),
        (lambda: ScaleBounds(min_scale=0.0), ScalerStateError, r"min_scale.*finite number > 0"),
        (lambda: ScaleBounds(max_scale=float("inf")), ScalerStateError, r"max_scale.*inf"),
        (lambda: ScaleBounds(max_scale=1e39), ScalerStateError, r"max_scale=1e\+39.*float32"),
        (lambda: ScaleBounds(min_scale=1e-46), ScalerStateError, r"min_scale=1e-46.*float32"),
        (
            lambda: ScaleBounds(min_scale=4.0, max_scale=2.0),
            ScalerStateError,
            r"min_scale \(4\.0\) must not exceed max_scale \(2\.0\)",
        ),
        (lambda: Layout(distinct_dims="pp"), TypeError, r"the string 'pp'.*\('pp',\)"),
        (lambda: Layout(distinct_dims=("pp", "")), TypeError, r"non-empty strings"),
        (lambda: Layout(distinct_params=torch.ones(2)), TypeError, r"wrap a single parameter"),
        (lambda: Layout(distinct_params=["w"]), TypeError, r"takes parameters \(tensors\)"),
        (lambda: SkipStreakLimit(max_skips=0), ValueError, r"max_skips=0.*\[1, 1000000\]"),
        (lambda: SkipStreakLimit(max_skips=10**6 + 1), ValueError, r"\[1, 1000000\]"),
        (lambda: SkipStreakLimit(max_skips=True), ValueError, r"max_skips=True"),
        (lambda: SkipStreakLimit(max_skips=2.0), ValueError, r"max_skips=2\.0"),
        (lambda: SpikeSkip(window=1), ValueError, r"window=1.*\[2, 65536\]"),
        (lambda: SpikeSkip(window=2**16 + 1), ValueError, r"window=65537.*\[2, 65536\]"),
        (lambda: SpikeSkip(warmup=10**7), ValueError, r"warmup=10000000.*\[2, 65536\]"),
        (lambda: SpikeSkip(z=None, ratio=2.0, warmup=0), ValueError, r"warmup=0.*\[1, 65536\]"),
    ],
    ids=lambda x: "" if callable(x) or isinstance(x, type) else x,
)
def test_each_option_object_refuses_bad_values_naming_them(
    build: Any, error: type[Exception], problem: str
) -> None:
    with pytest.raises(error, match=problem):
        build()


def test_the_range_limits_themselves_are_accepted_and_a_huge_warmup_is_refused_at_once() -> None:
    assert SkipStreakLimit(max_skips=10**6).max_skips == 10**6
    assert SpikeSkip(window=2**16, warmup=2**16).armed_after == 2**16
    assert ScaleBounds(min_scale=8.0, max_scale=8.0).max_scale == 8.0
    # It used to be accepted, and the first step then spent 12 s (larger values: minutes and
    # GBs) building the window's tables; the refusal is a comparison. The bound is far above
    # a comparison's cost and far below the seconds it used to take.
    start = time.perf_counter()
    for _ in range(10):
        with pytest.raises(ValueError, match="warmup"):
            SpikeSkip(warmup=10**7)
    assert time.perf_counter() - start < 1.0


def test_values_are_stored_normalised_so_equal_options_compare_and_show_the_same() -> None:
    assert SpikeSkip(z=6) == SpikeSkip(z=6.0) and repr(SpikeSkip(z=6)) == repr(SpikeSkip())
    assert isinstance(SpikeSkip(max_norm_abs=3).max_norm_abs, float)
    assert ScaleBounds(min_scale=2) == ScaleBounds(min_scale=2.0)
    assert repr(ScaleBounds(min_scale=2)) == repr(ScaleBounds(min_scale=2.0))
    assert SkipStreakLimit(max_skips=torch.tensor(3).item()) == SkipStreakLimit(3)
    assert Layout(distinct_dims=["tp", "pp", "pp"]).distinct_dims == ("pp", "tp")
    assert ScaleBounds().is_default and not ScaleBounds(hysteresis=2).is_default


def test_a_layout_reads_an_iterator_once_and_compares_parameters_by_identity() -> None:
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    layout = Layout(distinct_params=iter([a, b]))
    assert layout.distinct_params == (a, b)
    assert layout == Layout(distinct_params=[a, b]) and hash(layout) == hash(
        Layout(distinct_params=[a, b])
    )
    # Equal values, other tensors: another layout (never an elementwise tensor comparison).
    assert layout != Layout(distinct_params=[a, torch.nn.Parameter(torch.ones(2))])
    # Shown by shape, never by value (the values 1.0 say nothing about the layout).
    assert "1." not in repr(layout) and "(2,)" in repr(layout)


# -- the options on a scaler ---------------------------------------------------------------------


def test_policies_are_kept_as_given_and_at_most_one_of_each_kind() -> None:
    spike, loss, streak = SpikeSkip(window=8), LossCheck(), SkipStreakLimit(max_skips=5)
    scaler = ShardedGradScaler("cpu", policies=(p for p in (streak, spike, loss)))
    assert scaler.policies == (streak, spike, loss)
    for twins in ([LossCheck(), LossCheck()], [streak, SkipStreakLimit(max_skips=6)]):
        with pytest.raises(ValueError, match=r"two (LossCheck|SkipStreakLimit) policies"):
            ShardedGradScaler("cpu", policies=twins)
    with pytest.raises(TypeError, match="pass policies=\\(\\) for none"):
        ShardedGradScaler("cpu", policies=None)  # type: ignore[arg-type]
    assert ShardedGradScaler("cpu").policies == ()


def _verdicts(scaler: ShardedGradScaler, losses: list[float]) -> list[SkipReason]:
    """One step per loss on a one-parameter model whose gradient is finite; the reasons."""
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    reasons = []
    for value in losses:
        opt.zero_grad()
        # The constant's gradient is 0: the loss is non-finite, the gradient finite.
        loss = param.sum() + torch.tensor(value)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        reasons.append(SkipReason(int(scaler.last_skip_reason)))  # type: ignore[arg-type]
    return reasons


def test_loss_check_and_streak_limit_do_what_the_keywords_did() -> None:
    inf, ok = float("inf"), 1.0
    plain = ShardedGradScaler("cpu", loss_scaling=False)
    # No policy: the loss is not read.
    assert _verdicts(plain, [ok, inf, ok]) == [SkipReason.NONE] * 3
    checked = ShardedGradScaler("cpu", loss_scaling=False, policies=[LossCheck()])
    assert _verdicts(checked, [ok, inf, ok]) == [SkipReason.NONE, SkipReason.LOSS, SkipReason.NONE]
    limited = ShardedGradScaler(
        "cpu", loss_scaling=False, policies=[LossCheck(), SkipStreakLimit(max_skips=2)]
    )
    with pytest.raises(SkipStreakError, match=r"steps 2 to 3.*SkipStreakLimit\(max_skips=2\)"):
        _verdicts(limited, [ok, inf, inf, ok])


def test_scale_bounds_are_the_scalers_and_false_means_a_fixed_scale() -> None:
    bounded = ShardedGradScaler("cpu", loss_scaling=ScaleBounds(max_scale=1024.0))
    assert bounded.get_scale() == 1024.0  # the untyped default init_scale, clamped
    assert bounded.scale_bounds == ScaleBounds(max_scale=1024.0) and bounded.loss_scaling
    assert ShardedGradScaler("cpu", loss_scaling=True).scale_bounds == ScaleBounds()
    fixed = ShardedGradScaler("cpu", loss_scaling=False)
    assert not fixed.loss_scaling and fixed.get_scale() == 1.0
    with pytest.raises(TypeError, match=r"loss_scaling must be .*ScaleBounds\(\.\.\.\)"):
        ShardedGradScaler("cpu", loss_scaling=1)  # type: ignore[arg-type]


def test_state_dict_keys_are_unchanged() -> None:
    # The keys the scaler writes with every option on, written out here: the option objects
    # changed none of them.
    before = {
        "scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "_growth_tracker",
        "hysteresis",
        "_hysteresis_tracker",
        "min_scale",
        "max_scale",
        "spike_window",
        "spike_accepted",
        "_skip_streak",
        "_skip_streak_reasons",
        "_steps",  # with a streak: its step numbers after a resume (issue 27, item 6)
    }
    scaler = ShardedGradScaler(
        "cpu",
        loss_scaling=ScaleBounds(hysteresis=2, min_scale=1.0, max_scale=2.0**20),
        policies=[SpikeSkip(window=4, warmup=2), LossCheck(), SkipStreakLimit(max_skips=9)],
    )
    _verdicts(scaler, [1.0, float("inf"), 1.0])
    state = scaler.state_dict()
    assert set(state) == before
    fresh = ShardedGradScaler(
        "cpu",
        loss_scaling=ScaleBounds(hysteresis=2, min_scale=1.0, max_scale=2.0**20),
        policies=[SpikeSkip(window=4, warmup=2), LossCheck(), SkipStreakLimit(max_skips=9)],
    )
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    fixed = ShardedGradScaler("cpu", loss_scaling=False)
    assert set(fixed.state_dict()) == set(torch.amp.GradScaler("cpu").state_dict()) | {
        "loss_scaling"
    }


def test_options_survive_pickle_and_a_layout_follows_a_copied_model() -> None:
    model = torch.nn.Linear(2, 2)
    policies = (SpikeSkip(window=8), SkipStreakLimit(max_skips=3))
    scaler = ShardedGradScaler(
        "cpu",
        layout=Layout(distinct_dims=("pp",), distinct_params=[model.weight]),
        policies=policies,
        loss_scaling=ScaleBounds(hysteresis=2),
    )
    model2, scaler2 = pickle.loads(pickle.dumps((model, scaler)))
    assert scaler2.policies == policies and scaler2.scale_bounds == ScaleBounds(hysteresis=2)
    assert scaler2.layout.distinct_params[0] is model2.weight
    assert scaler2.layout.distinct_dims == ("pp",)
    assert scaler2.step_config.distinct_params == {id(model2.weight)}


def test_scale_bounds_write_only_their_fields_off_torchs_rules() -> None:
    assert ScaleBounds().state() == {}
    assert ScaleBounds(hysteresis=3).state() == {"hysteresis": 3}
    assert ScaleBounds(min_scale=1, max_scale=2.0**20).state() == {
        "min_scale": 1.0,
        "max_scale": 2.0**20,
    }
    scaler = ShardedGradScaler("cpu", loss_scaling=ScaleBounds(hysteresis=2, max_scale=2.0**20))
    state = scaler.state_dict()
    assert state["hysteresis"] == 2 and state["_hysteresis_tracker"] == 2
    assert state["max_scale"] == 2.0**20 and "min_scale" not in state
