"""Validation of every value that can enter a ShardedGradScaler: pure functions, no tensors.

[Note: what the scaler's tensors can hold]
The scale lives in a float32 tensor and the growth and hysteresis trackers in
int32 tensors, so a value is usable only if it survives that storage:

* A scale (``init_scale``, ``update(new_scale=...)``, a checkpoint's
  ``scale``, ``min_scale``/``max_scale``) must, *after rounding to float32*,
  lie in float32's normal range ``[2**-126, float32 max]``. Zero and inf are
  obviously fatal; a subnormal scale is too, because gradients are unscaled by
  its float32 reciprocal, which overflows to inf (every step would then be
  skipped for ever).
* ``growth_interval`` and ``hysteresis`` must fit in int32. The growth tracker
  is then kept below ``growth_interval`` (torch's kernel resets it when the
  interval completes), so ``tracker + 1`` never exceeds int32 max.
* ``growth_factor`` must be finite in float32 (the unfused update multiplies in
  float32) and ``backoff_factor`` at least float32's smallest normal number.
* The running update never leaves ``[floor, max_scale]``, where the floor is
  ``min_scale`` or, without one, float32's smallest normal number; see
  :func:`scale_floor`. Growth that would overflow is refused (torch's rule).
* Every scale that enters from outside must lie within ``[min_scale,
  max_scale]``: an explicit ``init_scale``, a ``new_scale`` or a checkpoint's
  scale outside them is an error. Only the untyped default ``init_scale`` is
  clamped into them (:func:`validate_init_scale`).
* A checkpoint is held to these limits but no stricter than torch where
  torch's own state is valid: a growth tracker at or past the interval is
  normalised, not refused (:func:`validate_growth_tracker`).

Every function either returns the normalised value or raises
:class:`ScalerStateError` naming the value, the limit and the fix.
"""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardscale.core._errors import ShardscaleError

__all__ = [
    "ScalerStateError",
    "ScalerValues",
    "DEFAULT_INIT_SCALE",
    "FLOAT32_TINY",
    "FLOAT32_MAX",
    "INT32_MAX",
    "STATE_KEYS",
    "round_to_float32",
    "scale_floor",
    "validate_scale",
    "validate_init_scale",
    "validate_growth_factor",
    "validate_backoff_factor",
    "validate_growth_interval",
    "validate_hysteresis",
    "validate_bounds",
    "validate_growth_tracker",
    "validate_hysteresis_tracker",
    "validate_state_dict",
    "validate_fixed_scale_options",
]

FLOAT32_TINY = 2.0**-126  # smallest positive normal float32
FLOAT32_MAX = (2.0 - 2.0**-23) * 2.0**127
INT32_MAX = 2**31 - 1


class _DefaultInitScale(float):
    """torch's default ``init_scale`` (2**16), marked so the constructor can tell it was not typed."""

    __slots__ = ()


DEFAULT_INIT_SCALE: float = _DefaultInitScale(2.0**16)

# The keys torch's GradScaler writes; every checkpoint must have them.
STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")

_RANGE = f"[{FLOAT32_TINY:.8g}, {FLOAT32_MAX:.8g}]"
_WHY_RANGE = (
    "the scale is kept in float32, and its reciprocal (which unscales the gradients) must be "
    "finite too, so it must lie in float32's normal range " + _RANGE
)


class ScalerStateError(ShardscaleError, ValueError, AssertionError):
    """A bad value for the scaler (a factor, a new scale, a state dict).

    It is an ``AssertionError`` too, because torch's GradScaler raises that for
    the same mistakes and code written for torch may catch it.
    """


@dataclass(frozen=True)
class ScalerValues:
    """A whole validated scaler state, ready to apply at once."""

    scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    growth_tracker: int
    hysteresis: int
    hysteresis_tracker: int
    min_scale: float | None
    max_scale: float | None


def round_to_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (±inf when it overflows)."""
    try:
        return float(struct.unpack("<f", struct.pack("<f", value))[0])
    except OverflowError:  # struct refuses what rounds to inf; the tensor would hold inf
        return math.copysign(math.inf, value)


def scale_floor(min_scale: float | None) -> float:
    """The lowest scale the running update may reach: ``min_scale``, else float32's smallest normal.

    A back-off that underflows is clamped here rather than raising: overflowing
    steps are data, not a mistake, and a zero or subnormal scale could never
    recover (its reciprocal is inf).
    """
    return FLOAT32_TINY if min_scale is None else min_scale


def _as_float(value: object) -> float | None:
    """``value`` as a float if it is a real number (not a bool), else None."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _as_int(value: object) -> int | None:
    """``value`` as an int if it is an integer (not a bool), else None."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return None


def _float32_problem(value: float) -> str | None:
    """Why ``value`` (finite, > 0) is no usable float32 scale, or None."""
    rounded = round_to_float32(value)
    if rounded == 0.0:
        return "rounds to 0.0 in float32"
    if math.isinf(rounded):
        return "rounds to inf in float32"
    if value > FLOAT32_MAX:
        # It would round to float32 max, but torch refuses to fill a float32 tensor with it.
        return f"is above float32's largest value {FLOAT32_MAX:.8g}"
    if rounded < FLOAT32_TINY:
        return f"is a float32 subnormal (below {FLOAT32_TINY:.8g}), whose reciprocal is inf"
    return None


def validate_scale(
    value: object,
    *,
    name: str,
    shown: str | None = None,
    noun: str = "number",
    min_scale: float | None = None,
    max_scale: float | None = None,
    fix: str = "",
    bounds_fix: str = "",
) -> float:
    """Check one scale value; return it as a Python float (unrounded, as torch keeps it).

    ``name`` names the value (``init_scale``, ``state dict key 'scale'``),
    ``shown`` is how messages show it with its value (default
    ``name=value``) and ``noun`` the kind of number asked for; ``fix`` ends
    the messages about the value itself, ``bounds_fix`` the one about the
    bounds. The bounds, already validated, are compared after rounding to
    float32, which is what the scale tensor holds.
    """
    number = _as_float(value)
    if number is None or not math.isfinite(number) or number <= 0:
        raise ScalerStateError(f"{name} must be a finite {noun} > 0, got {value!r}{fix}")
    shown = f"{name}={value!r}" if shown is None else shown
    problem = _float32_problem(number)
    if problem is not None:
        raise ScalerStateError(f"{shown} {problem}; {_WHY_RANGE}. Use a value in that range{fix}")
    rounded = round_to_float32(number)
    below = min_scale is not None and rounded < round_to_float32(min_scale)
    above = max_scale is not None and rounded > round_to_float32(max_scale)
    if below or above:
        label, bound = ("min_scale", min_scale) if below else ("max_scale", max_scale)
        raise ScalerStateError(
            f"{shown} is {'below' if below else 'above'} {label}={bound!r}: the scale must stay "
            f"within [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}]{bounds_fix}"
        )
    return number


def validate_init_scale(
    value: object, *, min_scale: float | None, max_scale: float | None
) -> float:
    """The constructor's ``init_scale``, checked against float32 and the (validated) bounds.

    An explicit value outside ``[min_scale, max_scale]`` is an error, not a clamp:
    the user typed it, and silently starting from another scale would hide a
    mistake in the scale or in the bounds. The default (:data:`DEFAULT_INIT_SCALE`,
    which the user never typed) is clamped into the bounds instead, so that
    ``ShardedGradScaler(max_scale=4096.0)`` simply starts at 4096.
    """
    if isinstance(value, _DefaultInitScale):
        scale = float(value)
        if min_scale is not None:
            scale = max(scale, min_scale)
        if max_scale is not None:
            scale = min(scale, max_scale)
        return scale
    return validate_scale(
        value,
        name="init_scale",
        min_scale=min_scale,
        max_scale=max_scale,
        bounds_fix="; pass an init_scale within [min_scale, max_scale], or widen the bounds",
    )


def validate_growth_factor(value: object, *, name: str = "growth_factor") -> float:
    """A finite number > 1 that float32 can hold (the unfused update multiplies in float32)."""
    number = _as_float(value)
    if number is None or not math.isfinite(number) or number <= 1.0:
        raise ScalerStateError(
            f"{name} must be a finite number > 1.0, got {value!r}; the default is 2.0"
        )
    if number > FLOAT32_MAX:
        raise ScalerStateError(
            f"{name} must be a finite number > 1.0 that float32 can hold (<= {FLOAT32_MAX:.8g}), "
            f"got {value!r}; the default is 2.0"
        )
    return number


def validate_backoff_factor(value: object, *, name: str = "backoff_factor") -> float:
    """A number in (0, 1), at least float32's smallest normal number (no zero in float32)."""
    number = _as_float(value)
    if number is None or not math.isfinite(number) or not 0.0 < number < 1.0:
        raise ScalerStateError(
            f"{name} must be a number in (0, 1), got {value!r}; the default is 0.5"
        )
    if number < FLOAT32_TINY:
        raise ScalerStateError(
            f"{name} must be a number in (0, 1) that float32 can hold (>= {FLOAT32_TINY:.8g}), "
            f"got {value!r}; the default is 0.5"
        )
    return number


def _validate_int32(value: object, *, name: str, low: int, hint: str) -> int:
    number = _as_int(value)
    if number is None or not low <= number <= INT32_MAX:
        raise ScalerStateError(
            f"{name} must be an int >= {low} and <= {INT32_MAX} (it is counted in an int32 "
            f"tensor), got {value!r}{hint}"
        )
    return number


def validate_growth_interval(value: object, *, name: str = "growth_interval") -> int:
    """An int in [1, int32 max]."""
    return _validate_int32(value, name=name, low=1, hint="; the default is 2000")


def validate_hysteresis(value: object, *, name: str = "hysteresis") -> int:
    """An int in [1, int32 max]."""
    return _validate_int32(value, name=name, low=1, hint="; the default is 1 (torch's behaviour)")


def validate_bounds(
    min_scale: object, max_scale: object, *, in_state_dict: bool = False
) -> tuple[float | None, float | None]:
    """Each bound None or a usable float32 scale, and min <= max (compared as float32)."""
    out: list[float | None] = []
    for label, bound in (("min_scale", min_scale), ("max_scale", max_scale)):
        if bound is None:
            out.append(None)
        elif in_state_dict:
            name = f"state dict key {label!r}"
            out.append(validate_scale(bound, name=name, shown=f"{name} ({bound!r})", noun="float"))
        else:
            out.append(validate_scale(bound, name=label, fix="; or None for no bound"))
    lo, hi = out
    if lo is not None and hi is not None and round_to_float32(lo) > round_to_float32(hi):
        if in_state_dict:
            raise ScalerStateError(
                f"state dict: min_scale ({lo}) must not exceed max_scale ({hi}); fix the "
                "checkpoint or the scaler's bounds"
            )
        raise ScalerStateError(f"min_scale ({lo}) must not exceed max_scale ({hi})")
    return lo, hi


def validate_growth_tracker(
    value: object, *, growth_interval: int, name: str = "state dict key '_growth_tracker'"
) -> int:
    """An int in [0, int32 max], normalised to at most ``growth_interval - 1``.

    torch writes a tracker >= the interval after ``set_growth_interval`` shrinks
    the interval, so such a state is accepted: the interval has already been
    completed, and the tracker is normalised to ``growth_interval - 1`` so that
    the next clean step grows the scale on every update path and ``tracker + 1``
    cannot wrap in int32. (torch's own kernel would never grow again: it waits
    for ``tracker + 1 == growth_interval``.)
    """
    tracker = _validate_int32(value, name=name, low=0, hint="")
    return min(tracker, growth_interval - 1)


def validate_hysteresis_tracker(
    value: object, *, hysteresis: int, name: str = "state dict key '_hysteresis_tracker'"
) -> int:
    """An int in [1, hysteresis]: the overflow steps left before the next back-off."""
    tracker = _validate_int32(value, name=name, low=1, hint="")
    if tracker > hysteresis:
        raise ScalerStateError(
            f"{name} is {tracker}, more than 'hysteresis' ({hysteresis}): it counts the overflow "
            "steps left before backing off, so it must be between 1 and 'hysteresis'; save the "
            "state with scaler.state_dict() instead of editing it"
        )
    return tracker


def validate_state_dict(
    state_dict: Mapping[str, Any],
    *,
    hysteresis: int,
    min_scale: float | None,
    max_scale: float | None,
) -> ScalerValues:
    """Validate a whole checkpoint; keys it lacks default to the scaler's current options.

    Raises on the first bad key; nothing is returned (so nothing can be
    applied) unless every key is good.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"load_state_dict() takes a dict, got {type(state_dict).__name__}")
    if len(state_dict) == 0:
        raise RuntimeError(
            "the scaler state dict is empty, probably saved from a disabled scaler; "
            "start from a fresh scaler instead of loading it."
        )
    missing = [k for k in STATE_KEYS if k not in state_dict]
    if missing:
        raise ScalerStateError(
            f"scaler state dict is missing key(s) {missing}; it needs {list(STATE_KEYS)} "
            "(saved by scaler.state_dict() after update())."
        )

    # The scale's own float32 check comes first, its bounds once they are known.
    scale = state_dict["scale"]
    scale_kw: dict[str, Any] = {
        "name": "state dict key 'scale'",
        "shown": f"state dict key 'scale' ({scale!r})",
        "noun": "float",
    }
    validate_scale(scale, **scale_kw)
    try:
        growth_factor = validate_growth_factor(state_dict["growth_factor"])
        backoff_factor = validate_backoff_factor(state_dict["backoff_factor"])
        growth_interval = validate_growth_interval(state_dict["growth_interval"])
    except ScalerStateError as exc:
        raise ScalerStateError(f"bad scaler state dict: {exc}") from None
    growth_tracker = validate_growth_tracker(
        state_dict["_growth_tracker"], growth_interval=growth_interval
    )
    hyst = validate_hysteresis(
        state_dict.get("hysteresis", hysteresis), name="state dict key 'hysteresis'"
    )
    hyst_tracker = validate_hysteresis_tracker(
        state_dict.get("_hysteresis_tracker", hyst), hysteresis=hyst
    )
    lo, hi = validate_bounds(
        state_dict.get("min_scale", min_scale),
        state_dict.get("max_scale", max_scale),
        in_state_dict=True,
    )
    value = validate_scale(
        scale,
        **scale_kw,
        min_scale=lo,
        max_scale=hi,
        bounds_fix=(
            "; load it into a scaler built with bounds that include it, or set the checkpoint's "
            "'min_scale'/'max_scale' (or 'scale') so that they do"
        ),
    )
    return ScalerValues(
        scale=value,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        growth_tracker=growth_tracker,
        hysteresis=hyst,
        hysteresis_tracker=hyst_tracker,
        min_scale=lo,
        max_scale=hi,
    )


def validate_fixed_scale_options(
    *,
    init_scale: object,
    growth_factor: object,
    backoff_factor: object,
    growth_interval: object,
    hysteresis: object,
    min_scale: object,
    max_scale: object,
) -> None:
    """``loss_scaling=False`` fixes the scale at 1: refuse options that would move it.

    Anything but the defaults (or ``init_scale=1.0``) contradicts the fixed
    scale, so it is an error naming each such option rather than silently ignored.
    """
    defaults: dict[str, object] = {
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "hysteresis": 1,
        "min_scale": None,
        "max_scale": None,
    }
    given = {
        "growth_factor": growth_factor,
        "backoff_factor": backoff_factor,
        "growth_interval": growth_interval,
        "hysteresis": hysteresis,
        "min_scale": min_scale,
        "max_scale": max_scale,
    }
    problems = [f"{k}={v!r}" for k, v in given.items() if v != defaults[k]]
    if not isinstance(init_scale, _DefaultInitScale) and init_scale != 1.0:
        problems.insert(0, f"init_scale={init_scale!r}")
    if problems:
        raise ScalerStateError(
            f"loss_scaling=False fixes the scale at 1 (bf16/fp32 training: nothing to grow or back "
            f"off), so {', '.join(problems)} would have no effect; drop "
            f"{'it' if len(problems) == 1 else 'them'}, or pass loss_scaling=True (fp16) to "
            "scale the loss"
        )
