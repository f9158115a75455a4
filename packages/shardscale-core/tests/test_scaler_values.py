"""Values that can't break the scaler: what float32 and int32 can hold, bounds, whole checkpoints.

The scale lives in a float32 tensor and both trackers in int32 tensors, so a
value is only usable if it survives that: a scale must stay finite and a normal
number (its float32 reciprocal unscales the gradients, so a subnormal scale
makes every gradient inf), intervals and trackers must fit in int32 and the
tracker arithmetic (``tracker + 1``) must never wrap. Each table below builds a
value the scaler used to accept and then turn into nan weights, a zero scale, a
scale that doubles every step, a wrapped tracker or a crash after the optimizer
step; now it is rejected up front with a :class:`ScalerStateError` that names
the value, the limit and the fix, and nothing changes — or, where torch's own
state is valid, it is normalised and training goes on.

Every limit is derived here from ``torch.finfo``/``torch.iinfo``, not read from
the code under test. Scales are powers of two (or float32 limits), so every
comparison is exact: there is no tolerance to choose.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from shardscale.core import ScaleBounds, ScalerStateError, ShardedGradScaler

F32 = torch.finfo(torch.float32)
TINY = float(F32.tiny)  # smallest positive *normal* float32: 2**-126
F32_MAX = float(F32.max)
I32_MAX = int(torch.iinfo(torch.int32).max)

# How the messages print the float32 range (8 significant digits name a float32 exactly).
TINY_TEXT = re.escape(f"{TINY:.8g}")
MAX_TEXT = re.escape(f"{F32_MAX:.8g}")

# The option sets that select each update path: torch's fused kernel, and the tensor
# arithmetic used for hysteresis and for bounds.
PATHS: dict[str, dict[str, Any]] = {
    "fused": {},
    "hysteresis": {"hysteresis": 2},
    "bounds": {"min_scale": TINY, "max_scale": F32_MAX},
}


def _f32(x: float) -> float:
    """``x`` rounded to float32 the way torch rounds it (an independent reference)."""
    return float(torch.tensor(x, dtype=torch.float64).to(torch.float32))


def _scaler(**kwargs: Any) -> ShardedGradScaler:
    """A scaler; ``hysteresis``/``min_scale``/``max_scale`` go into ``loss_scaling=ScaleBounds(...)``."""
    bounds = {k: kwargs.pop(k) for k in ("hysteresis", "min_scale", "max_scale") if k in kwargs}
    if bounds:
        kwargs["loss_scaling"] = ScaleBounds(**bounds)
    return ShardedGradScaler("cpu", backend="local", **kwargs)


class _Toy:
    """A tiny fp32 model with a real optimizer, for driving whole iterations."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 3)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.gen = torch.Generator().manual_seed(seed)

    def backward(self, scaler: ShardedGradScaler, *, overflow: bool = False) -> None:
        self.opt.zero_grad()
        x = torch.randn(5, 4, generator=self.gen)
        if overflow:
            x[0, 0] = math.inf
        scaler.scale(self.model(x).square().mean()).backward()

    def iterate(self, scaler: ShardedGradScaler, *, overflow: bool = False) -> float:
        self.backward(scaler, overflow=overflow)
        scaler.step(self.opt)
        scaler.update()
        return scaler.get_scale()

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _bits(t: torch.Tensor | None) -> Any:
    if t is None:
        return None
    return (t.dtype, tuple(t.shape), t.detach().reshape(-1).view(torch.uint8).tolist())


def _snapshot(s: ShardedGradScaler) -> dict[str, Any]:
    """Every piece of scaler state a rejected call must leave alone."""
    return {
        "state_dict": s.state_dict(),
        "scale": _bits(s._scale),
        "growth_tracker": _bits(s._growth_tracker),
        "hysteresis_tracker": _bits(s._hysteresis_tracker),
        "config": (
            s._init_scale,
            s._growth_factor,
            s._backoff_factor,
            s._growth_interval,
            s._init_growth_tracker,
            s._hysteresis,
            s._init_hysteresis_tracker,
            s._min_scale,
            s._max_scale,
        ),
        "pending": sorted(id_ for id_ in s._per_optimizer_states),
    }


def _check_message(exc: BaseException, problem: str, fix: str) -> None:
    message = str(exc)
    assert re.search(problem, message, re.S), f"no {problem!r} in: {message}"
    assert re.search(fix, message, re.S), f"no {fix!r} in: {message}"


# --------------------------------------------------------------------------------------------
# the constructor


@dataclass(frozen=True)
class CtorCase:
    id: str
    kwargs: dict[str, Any]
    problem: str
    fix: str


RANGE = rf"{TINY_TEXT}.*{MAX_TEXT}"

CTOR_CASES = [
    CtorCase("init-scale-rounds-to-zero", {"init_scale": 1e-46}, r"init_scale=1e-46", RANGE),
    CtorCase("init-scale-subnormal", {"init_scale": 1e-40}, r"init_scale=1e-40", RANGE),
    CtorCase("init-scale-rounds-to-inf", {"init_scale": 1e39}, r"init_scale=1e\+39", RANGE),
    # Rounds to float32 max, yet torch refuses to fill a float32 tensor with it.
    CtorCase(
        "init-scale-just-above-float32-max",
        {"init_scale": F32_MAX * (1 + 2**-25)},
        r"init_scale=3\.40282356",
        RANGE,
    ),
    CtorCase(
        "growth-interval-past-int32",
        {"growth_interval": 2**31},
        r"growth_interval.*2147483648",
        r"<= 2147483647",
    ),
    CtorCase(
        "growth-interval-past-int32-with-hysteresis",
        {"growth_interval": 2**31, "hysteresis": 2},
        r"growth_interval.*2147483648",
        r"<= 2147483647",
    ),
    CtorCase(
        "growth-interval-past-int64",
        {"growth_interval": 2**63},
        r"growth_interval.*9223372036854775808",
        r"<= 2147483647",
    ),
    CtorCase(
        "hysteresis-past-int32", {"hysteresis": 2**31}, r"hysteresis.*2147483648", r"<= 2147483647"
    ),
    CtorCase(
        "hysteresis-huge", {"hysteresis": 2**40}, r"hysteresis.*1099511627776", r"<= 2147483647"
    ),
    CtorCase(
        "growth-factor-past-float32", {"growth_factor": 1e39}, r"growth_factor.*1e\+39", MAX_TEXT
    ),
    CtorCase(
        "backoff-factor-rounds-to-zero",
        {"backoff_factor": 1e-46},
        r"backoff_factor.*1e-46",
        TINY_TEXT,
    ),
    CtorCase("min-scale-rounds-to-zero", {"min_scale": 1e-46}, r"min_scale=1e-46", RANGE),
    CtorCase("max-scale-rounds-to-zero", {"max_scale": 1e-46}, r"max_scale=1e-46", RANGE),
    CtorCase("max-scale-rounds-to-inf", {"max_scale": 1e39}, r"max_scale=1e\+39", RANGE),
    CtorCase(
        "init-scale-below-min-scale",
        {"init_scale": 4.0, "min_scale": 8.0},
        r"init_scale=4\.0.*min_scale=8\.0",
        r"init_scale within \[min_scale, max_scale\]",
    ),
    CtorCase(
        "init-scale-above-max-scale",
        {"init_scale": 2.0**20, "max_scale": 1024.0},
        r"init_scale=1048576\.0.*max_scale=1024\.0",
        r"init_scale within \[min_scale, max_scale\]",
    ),
    CtorCase(
        # Explicit, even though it equals the default: an error.
        "explicit-default-value-above-max-scale",
        {"init_scale": 2.0**16, "max_scale": 1024.0},
        r"init_scale=65536\.0.*max_scale=1024\.0",
        r"init_scale within \[min_scale, max_scale\]",
    ),
]


@pytest.mark.parametrize("case", CTOR_CASES, ids=[c.id for c in CTOR_CASES])
def test_constructor_rejects_values_float32_or_int32_cannot_hold(case: CtorCase) -> None:
    with pytest.raises(ScalerStateError) as info:
        _scaler(**case.kwargs)
    _check_message(info.value, case.problem, case.fix)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"init_scale": TINY},
        {"init_scale": F32_MAX},
        {"growth_interval": I32_MAX},
        {"growth_interval": I32_MAX, "hysteresis": I32_MAX},
        {"growth_factor": F32_MAX, "backoff_factor": TINY},
        {"init_scale": 8.0, "min_scale": 8.0, "max_scale": 8.0},
        # float32(0.1) > 0.1, but both are the same float32, which is what the scale holds.
        {"init_scale": _f32(0.1), "max_scale": 0.1},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_constructor_accepts_the_limits_themselves(kwargs: dict[str, Any]) -> None:
    scaler = _scaler(**kwargs)
    toy = _Toy()
    toy.iterate(scaler)
    assert all(torch.isfinite(w).all() for w in toy.weights())


@pytest.mark.parametrize(
    ("bounds", "start"),
    [({"max_scale": 1024.0}, 1024.0), ({"min_scale": 2.0**20}, 2.0**20), ({}, 2.0**16)],
    ids=["below-max", "above-min", "no-bounds"],
)
def test_the_untyped_default_init_scale_starts_inside_the_bounds(
    bounds: dict[str, float], start: float
) -> None:
    """The user never typed 2**16; it is clamped into the bounds they did type."""
    scaler = _scaler(**bounds)
    assert scaler.get_scale() == start
    toy = _Toy()
    toy.backward(scaler)
    assert scaler._scale is not None and float(scaler._scale) == start
    assert scaler.state_dict()["scale"] == start


# --------------------------------------------------------------------------------------------
# setters and update(new_scale=...)


@dataclass(frozen=True)
class CallCase:
    id: str
    call: Callable[[ShardedGradScaler], object]
    problem: str
    fix: str
    scaler_kwargs: dict[str, Any] = field(default_factory=dict)


CALL_CASES = [
    CallCase(
        "set-growth-interval-past-int32",
        lambda s: s.set_growth_interval(2**31),
        r"growth_interval.*2147483648",
        r"<= 2147483647",
    ),
    CallCase(
        "set-growth-interval-past-int32-with-hysteresis",
        lambda s: s.set_growth_interval(2**31),
        r"growth_interval.*2147483648",
        r"<= 2147483647",
        {"hysteresis": 2},
    ),
    CallCase(
        "set-growth-factor-past-float32",
        lambda s: s.set_growth_factor(1e39),
        r"growth_factor.*1e\+39",
        MAX_TEXT,
    ),
    CallCase(
        "set-backoff-factor-rounds-to-zero",
        lambda s: s.set_backoff_factor(1e-46),
        r"backoff_factor.*1e-46",
        TINY_TEXT,
    ),
    CallCase(
        "new-scale-rounds-to-zero",
        lambda s: s.update(new_scale=1e-46),
        r"new_scale=1e-46",
        RANGE,
    ),
    CallCase(
        "new-scale-subnormal",
        lambda s: s.update(new_scale=1e-40),
        r"new_scale=1e-40",
        RANGE,
    ),
    CallCase(
        "new-scale-rounds-to-inf",
        lambda s: s.update(new_scale=1e39),
        r"new_scale=1e\+39",
        RANGE,
    ),
    CallCase(
        "new-scale-float64-tensor-rounds-to-zero",
        lambda s: s.update(new_scale=torch.tensor(1e-46, dtype=torch.float64)),
        r"1e-46",
        RANGE,
    ),
    CallCase(
        "new-scale-float64-tensor-rounds-to-inf",
        lambda s: s.update(new_scale=torch.tensor(1e39, dtype=torch.float64)),
        r"1e\+39",
        RANGE,
    ),
    CallCase(
        "new-scale-below-min-scale",
        lambda s: s.update(new_scale=2.0),
        r"new_scale=2\.0.*min_scale=8\.0",
        r"within \[min_scale, max_scale\]",
        {"init_scale": 64.0, "min_scale": 8.0},
    ),
    CallCase(
        "new-scale-above-max-scale",
        lambda s: s.update(new_scale=2.0**20),
        r"new_scale=1048576\.0.*max_scale=1024\.0",
        r"within \[min_scale, max_scale\]",
        {"init_scale": 64.0, "max_scale": 1024.0},
    ),
    CallCase(
        "new-scale-tensor-below-min-scale",
        lambda s: s.update(new_scale=torch.tensor(2.0)),
        r"2\.0.*min_scale=8\.0",
        r"within \[min_scale, max_scale\]",
        {"init_scale": 64.0, "min_scale": 8.0, "hysteresis": 3},
    ),
]


@pytest.mark.parametrize("case", CALL_CASES, ids=[c.id for c in CALL_CASES])
def test_bad_call_raises_and_changes_nothing(case: CallCase) -> None:
    scaler = _scaler(growth_interval=3, **case.scaler_kwargs)
    toy = _Toy()
    toy.iterate(scaler)
    toy.backward(scaler)
    scaler.step(toy.opt)  # mid-iteration: update() is what comes next
    before = _snapshot(scaler)
    with pytest.raises(ScalerStateError) as info:
        case.call(scaler)
    _check_message(info.value, case.problem, case.fix)
    assert _snapshot(scaler) == before
    # The iteration is still usable.
    scaler.update()
    assert 0 < scaler.get_scale() < math.inf


# --------------------------------------------------------------------------------------------
# load_state_dict: all or nothing


def _source_state() -> dict[str, Any]:
    """A checkpoint in which every key differs from the target scaler's current value."""
    src = _scaler(
        init_scale=2.0**12,
        growth_factor=4.0,
        backoff_factor=0.25,
        growth_interval=5,
        hysteresis=3,
        min_scale=0.5,
        max_scale=2.0**22,
    )
    toy = _Toy(seed=1)
    for overflow in (False, True, False, False):
        toy.iterate(src, overflow=overflow)
    state = src.state_dict()
    assert state["_growth_tracker"] == 2 and state["_hysteresis_tracker"] == 3
    return state


def _target(stage: str) -> ShardedGradScaler:
    scaler = _scaler(init_scale=2.0**10, hysteresis=2, min_scale=1.0, max_scale=2.0**20)
    if stage == "trained":
        toy = _Toy()
        for overflow in (False, True, False):
            toy.iterate(scaler, overflow=overflow)
        assert scaler._scale is not None
    return scaler


@dataclass(frozen=True)
class LoadCase:
    id: str
    overrides: dict[str, Any]
    problem: str
    fix: str
    drop: tuple[str, ...] = ()


LOAD_CASES = [
    LoadCase("scale-rounds-to-zero", {"scale": 1e-46}, r"'scale'.*1e-46", RANGE),
    LoadCase("scale-subnormal", {"scale": 1e-40}, r"'scale'.*1e-40", RANGE),
    LoadCase("scale-rounds-to-inf", {"scale": 1e39}, r"'scale'.*1e\+39", RANGE),
    LoadCase(
        "scale-below-its-min-scale",
        {"scale": 0.25},
        r"'scale'.*0\.25.*min_scale=0\.5",
        r"min_scale",
    ),
    LoadCase(
        "scale-above-its-max-scale",
        {"scale": 2.0**23},
        r"'scale'.*8388608\.0.*max_scale=4194304\.0",
        r"max_scale",
    ),
    LoadCase(
        # A torch checkpoint (no bound keys) into a scaler whose own bounds it breaks.
        "torch-scale-above-the-scalers-max-scale",
        {"scale": 2.0**21},
        r"'scale'.*2097152\.0.*max_scale=1048576\.0",
        r"max_scale",
        drop=("hysteresis", "_hysteresis_tracker", "min_scale", "max_scale"),
    ),
    LoadCase(
        "growth-factor-past-float32", {"growth_factor": 1e39}, r"growth_factor.*1e\+39", MAX_TEXT
    ),
    LoadCase(
        "backoff-factor-rounds-to-zero",
        {"backoff_factor": 1e-46},
        r"backoff_factor.*1e-46",
        TINY_TEXT,
    ),
    LoadCase(
        "growth-interval-past-int32",
        {"growth_interval": 2**31},
        r"growth_interval.*2147483648",
        r"<= 2147483647",
    ),
    LoadCase(
        "growth-interval-past-int64",
        {"growth_interval": 2**63},
        r"growth_interval.*9223372036854775808",
        r"<= 2147483647",
    ),
    LoadCase(
        "growth-tracker-past-int32",
        {"_growth_tracker": 2**31},
        r"'_growth_tracker'.*2147483648",
        r"<= 2147483647",
    ),
    LoadCase(
        "growth-tracker-past-int64",
        {"_growth_tracker": 2**63},
        r"'_growth_tracker'.*9223372036854775808",
        r"<= 2147483647",
    ),
    LoadCase(
        "hysteresis-past-int32",
        {"hysteresis": 2**31},
        r"'hysteresis'.*2147483648",
        r"<= 2147483647",
    ),
    LoadCase(
        "hysteresis-huge", {"hysteresis": 2**40}, r"'hysteresis'.*1099511627776", r"<= 2147483647"
    ),
    LoadCase(
        "hysteresis-tracker-past-int32",
        {"_hysteresis_tracker": 2**31},
        r"'_hysteresis_tracker'.*2147483648",
        r"<= 2147483647",
    ),
    LoadCase(
        "hysteresis-tracker-above-hysteresis",
        {"_hysteresis_tracker": 5},
        r"'_hysteresis_tracker'.*5.*'hysteresis'.*3",
        r"between 1 and",
    ),
    LoadCase("min-scale-rounds-to-zero", {"min_scale": 1e-46}, r"'min_scale'.*1e-46", RANGE),
    LoadCase("max-scale-rounds-to-zero", {"max_scale": 1e-46}, r"'max_scale'.*1e-46", RANGE),
    LoadCase("max-scale-rounds-to-inf", {"max_scale": 1e39}, r"'max_scale'.*1e\+39", RANGE),
]


@pytest.mark.parametrize("stage", ["fresh", "trained"])
@pytest.mark.parametrize("case", LOAD_CASES, ids=[c.id for c in LOAD_CASES])
def test_bad_checkpoint_raises_and_changes_nothing(case: LoadCase, stage: str) -> None:
    state = _source_state()
    for key in case.drop:
        state.pop(key)
    state.update(case.overrides)
    scaler = _target(stage)
    before = _snapshot(scaler)
    with pytest.raises(ScalerStateError) as info:
        scaler.load_state_dict(state)
    _check_message(info.value, case.problem, case.fix)
    assert _snapshot(scaler) == before


def test_the_good_source_state_loads() -> None:
    """The table's base checkpoint is valid: each case fails only for its own key."""
    state = _source_state()
    for stage in ("fresh", "trained"):
        scaler = _target(stage)
        scaler.load_state_dict(state)
        assert scaler.state_dict() == state


# --------------------------------------------------------------------------------------------
# the growth tracker: never wraps, and a tracker at/over the interval means "grow next"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("interval", "tracker"),
    [(4, 4), (4, 9), (4, I32_MAX), (I32_MAX, I32_MAX)],
    ids=["at-interval", "past-interval", "int32-max", "both-int32-max"],
)
def test_loaded_tracker_at_or_past_the_interval_grows_at_the_next_clean_step(
    path: str, interval: int, tracker: int
) -> None:
    scaler = _scaler(**PATHS[path])
    state = {**scaler.state_dict(), "scale": 64.0, "growth_interval": interval}
    state["_growth_tracker"] = tracker
    scaler.load_state_dict(state)
    toy = _Toy()
    scales = [toy.iterate(scaler) for _ in range(3)]
    # The interval had already been completed: grow once, then count again from 0 (the
    # interval, 4 or more, is not completed again within these three steps).
    assert scales == [128.0, 128.0, 128.0]
    assert 0 <= scaler._get_growth_tracker() < interval


def test_torch_state_with_a_shrunk_interval_loads_and_grows() -> None:
    """torch writes tracker > interval after set_growth_interval shrinks it; we accept that."""
    ref = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=10)
    toy = _Toy()
    for _ in range(3):
        toy.iterate(ref)  # type: ignore[arg-type]
    ref.set_growth_interval(2)
    state = ref.state_dict()
    assert state["_growth_tracker"] == 3 > state["growth_interval"]
    ours = _scaler()
    ours.load_state_dict(state)
    assert _Toy().iterate(ours) == 512.0


@pytest.mark.parametrize("path", PATHS)
def test_shrinking_the_interval_below_the_tracker_grows_at_the_next_clean_step(path: str) -> None:
    scaler = _scaler(init_scale=256.0, growth_interval=10, **PATHS[path])
    toy = _Toy()
    for _ in range(3):
        toy.iterate(scaler)
    scaler.set_growth_interval(2)
    assert toy.iterate(scaler) == 512.0
    assert 0 <= scaler._get_growth_tracker() < 2


@pytest.mark.parametrize("path", PATHS)
def test_the_interval_completes_at_int32_max(path: str) -> None:
    """``tracker + 1`` reaches exactly int32 max, and ``>= interval`` still fires there."""
    scaler = _scaler(growth_interval=I32_MAX, **PATHS[path])
    state = scaler.state_dict()
    scaler.load_state_dict({**state, "scale": 64.0, "_growth_tracker": I32_MAX - 2})
    toy = _Toy()
    assert toy.iterate(scaler) == 64.0
    assert scaler._get_growth_tracker() == I32_MAX - 1
    assert toy.iterate(scaler) == 128.0
    assert scaler._get_growth_tracker() == 0


def test_the_limits_match_torch_where_torch_is_fine() -> None:
    """On the default path the numbers at the int32/float32 limits are torch's, bit for bit."""
    state = {
        "scale": 64.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": I32_MAX,
        "_growth_tracker": I32_MAX - 2,
    }
    ours, ref = _scaler(), torch.amp.GradScaler("cpu")
    ours.load_state_dict(dict(state))
    ref.load_state_dict(dict(state))
    toys = (_Toy(), _Toy())
    for overflow in (False, False, False, True, False):
        for scaler, toy in zip((ours, ref), toys, strict=True):
            toy.iterate(scaler, overflow=overflow)  # type: ignore[arg-type]
        assert ours.state_dict() == ref.state_dict()
        for a, b in zip(*(t.weights() for t in toys), strict=True):
            assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# the running update at the float32 limits, on every path


@pytest.mark.parametrize("path", PATHS)
def test_growth_that_would_overflow_float32_is_refused_and_the_tracker_resets(path: str) -> None:
    top = 2.0**127  # the largest power of two in float32: doubling it overflows
    scaler = _scaler(init_scale=top, growth_interval=1, **PATHS[path])
    toy = _Toy()
    for _ in range(4):
        assert toy.iterate(scaler) == top
        # torch's kernel resets the tracker when the interval completes, grown or not.
        assert scaler._get_growth_tracker() == 0


@pytest.mark.parametrize("path", PATHS)
def test_a_growth_factor_at_float32_max_never_makes_the_scale_inf(path: str) -> None:
    scaler = _scaler(init_scale=2.0, growth_factor=F32_MAX, growth_interval=1, **PATHS[path])
    toy = _Toy()
    scales = [toy.iterate(scaler) for _ in range(3)]
    assert all(math.isfinite(s) and s > 0 for s in scales)


@pytest.mark.parametrize("path", ["fused", "hysteresis"])
@pytest.mark.parametrize("backoff", [0.5, 1e-30])
def test_backing_off_never_reaches_zero_or_a_subnormal(path: str, backoff: float) -> None:
    scaler = _scaler(init_scale=4 * TINY, backoff_factor=backoff, **PATHS[path])
    toy = _Toy()
    hysteresis = PATHS[path].get("hysteresis", 1)
    expected = 4 * TINY
    for step in range(6):
        got = toy.iterate(scaler, overflow=True)
        if step >= hysteresis - 1:  # the hysteresis-th consecutive overflow, and every one after
            # The float32 product, floored at float32's smallest normal number.
            expected = max(_f32(expected * _f32(backoff)), TINY)
        assert got == expected
    assert scaler.get_scale() == TINY


def test_backing_off_stops_at_min_scale() -> None:
    scaler = _scaler(init_scale=1.0, backoff_factor=1e-30, min_scale=2.0**-100)
    toy = _Toy()
    assert toy.iterate(scaler, overflow=True) == _f32(1e-30)
    assert toy.iterate(scaler, overflow=True) == 2.0**-100


def test_bounds_never_take_the_fused_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = torch._amp_update_scale_

    def spy(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(torch, "_amp_update_scale_", spy)
    for kwargs in ({"min_scale": 1.0}, {"max_scale": 2.0**20}, {"hysteresis": 2}):
        toy, scaler = _Toy(), _scaler(**kwargs)
        toy.iterate(scaler)
        toy.iterate(scaler, overflow=True)
    assert calls == []
    # Bounds that arrive with a checkpoint switch the path too.
    scaler = _scaler()
    scaler.load_state_dict({**scaler.state_dict(), "max_scale": 2.0**20})
    _Toy().iterate(scaler)
    assert calls == []
    _Toy().iterate(_scaler())  # the spy does see the default path
    assert calls == [1]


# --------------------------------------------------------------------------------------------
# real training with the values that used to break it


def _assert_finite(toy: _Toy) -> None:
    for w in toy.weights():
        assert torch.isfinite(w).all(), "nan/inf weights"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"init_scale": 1e-46},
        {"init_scale": 1e39},
        {"growth_interval": 2**31, "hysteresis": 2},
        {"growth_interval": 2**31, "min_scale": 1.0},
        {"growth_interval": 2**63},
        {"hysteresis": 2**40},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_training_with_a_value_that_used_to_break_it(kwargs: dict[str, Any]) -> None:
    """Either the value is refused before any step, or training stays finite and sane."""
    toy = _Toy()
    start = toy.weights()
    try:
        scaler = _scaler(**kwargs)
    except ScalerStateError:
        assert all(torch.equal(a, b) for a, b in zip(start, toy.weights(), strict=True))
        return
    scales = [toy.iterate(scaler) for _ in range(6)]
    _assert_finite(toy)
    assert all(0 < s < math.inf for s in scales)
    # growth_interval is far away: the scale must not move at all.
    assert len(set(scales)) == 1, f"the scale moved: {scales}"


@pytest.mark.parametrize("path", ["fused", "hysteresis"])
def test_training_through_repeated_overflows_with_a_tiny_backoff(path: str) -> None:
    """The scale used to hit 0, after which every step was skipped forever."""
    scaler = _scaler(init_scale=1.0, backoff_factor=1e-30, growth_interval=1, **PATHS[path])
    toy = _Toy()
    scales = [toy.iterate(scaler, overflow=True) for _ in range(6)]
    assert all(s >= TINY for s in scales), scales
    before = toy.weights()
    scales = [toy.iterate(scaler) for _ in range(6)]
    _assert_finite(toy)
    # Clean steps are taken (the weights move) and the scale grows back from the floor.
    assert not all(torch.equal(a, b) for a, b in zip(before, toy.weights(), strict=True))
    assert scales == sorted(scales) and scales[-1] > scales[0] >= TINY


@pytest.mark.parametrize("path", PATHS)
def test_training_resumed_from_a_tracker_at_int32_max(path: str) -> None:
    """Such a checkpoint used to wrap the tracker to -2**31 and stop growth for good."""
    scaler = _scaler(**PATHS[path])
    scaler.load_state_dict(
        {
            **scaler.state_dict(),
            "scale": 64.0,
            "growth_interval": 3,
            "_growth_tracker": I32_MAX,
        }
    )
    toy = _Toy()
    scales = [toy.iterate(scaler) for _ in range(7)]
    _assert_finite(toy)
    assert scales == [128.0, 128.0, 128.0, 256.0, 256.0, 256.0, 512.0]
    assert 0 <= scaler._get_growth_tracker() < 3
