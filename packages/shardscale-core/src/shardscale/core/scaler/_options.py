"""The scaler's option objects: frozen, self-validating families of keywords beyond torch's.

[Note: the scaler's options]
``ShardedGradScaler`` takes torch's seven arguments and at most six keyword
options; the families among them are frozen objects in the style of FSDP2's
``MixedPrecisionPolicy``: each checks its fields in ``__post_init__`` (so a bad
value is refused where it is written, before any scaler exists), compares and
hashes by value, and is shown by ``repr`` in a form that builds it again.

* :class:`ScaleBounds` -- ``loss_scaling=ScaleBounds(...)``: dynamic scaling
  with hysteresis and a floor/ceiling for the scale. Its fields are also the
  ``"hysteresis"``/``"min_scale"``/``"max_scale"`` keys of ``state_dict()``.
* :class:`Layout` -- ``layout=Layout(...)``: what this rank declares about
  where its parameters live (``distinct_dims``, ``distinct_params``).
* the skip policies -- ``policies=[...]``: :class:`~shardscale.core.SpikeSkip`,
  :class:`LossCheck`, :class:`SkipStreakLimit`, at most one of each kind.

What must agree across ranks rides in the step's declarations (see [Note:
declarations] in ``step._engine``): the scale bounds and the policies that
decide on the reduced vector (spike, streak) through :func:`declared_options`; the
layout through ``StepConfig``. :class:`LossCheck` is not declared: each rank
adds its own loss flag (0 without a loss, as a pipeline's first stages), so
ranks that differ still take one verdict.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, ParamSpec, TypeAlias

import torch

from shardscale.core.scaler._values import ScalerStateError, validate_bounds, validate_hysteresis
from shardscale.core.step._contract import check_distinct_dims, distinct_param_ids
from shardscale.core.step._verdict import SpikeSkip

__all__ = [
    "Layout",
    "LossCheck",
    "MAX_STREAK",
    "ScaleBounds",
    "BuiltinPolicy",
    "SkipStreakLimit",
    "SplitPolicies",
    "check_loss_scaling_option",
    "declared_options",
    "moved_keywords_error",
    "refuse_moved_keywords",
    "split_policies",
]

#: The largest ``SkipStreakLimit.max_skips``. The streak is one device counter, so the bound is
#: about meaning, not memory: a million skipped steps in a row is a run that never trains, and a
#: limit past it can only be a typo (leave the policy out never to stop).
MAX_STREAK = 1_000_000

P = ParamSpec("P")


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleBounds:
    """Dynamic loss scaling with hysteresis and bounds: ``loss_scaling=ScaleBounds(...)``.

    ``ScaleBounds()`` is torch's dynamic scaling (``loss_scaling=True``).

    Args:
        hysteresis: back off only after this many consecutive overflow steps
            (Megatron-LM / DeepSpeed style); an int in ``[1, 2**31 - 1]`` (the
            count lives in an int32 tensor). 1 is torch's behaviour.
        min_scale, max_scale: bounds the scale never leaves; ``None`` for none.
            Each must be a float32 normal number (so the scale's reciprocal,
            which unscales the gradients, is finite), and ``min_scale <=
            max_scale``. An explicit ``init_scale`` outside them is refused;
            the default one is clamped into them.

    With anything but the defaults the update runs as a few tensor ops on the
    scale's device (no host sync) instead of torch's fused update kernel. The
    non-default fields are written to ``state_dict()`` (keys ``hysteresis``,
    ``min_scale``, ``max_scale``, beside ``_hysteresis_tracker``), and a
    checkpoint's values replace the scaler's on ``load_state_dict``.
    """

    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None

    def __post_init__(self) -> None:
        try:
            hysteresis = validate_hysteresis(self.hysteresis)
            low, high = validate_bounds(self.min_scale, self.max_scale)
        except ScalerStateError as exc:
            raise ScalerStateError(f"ScaleBounds: {exc}") from None
        # Stored normalised (an int, floats), so that equal bounds compare and show the same.
        object.__setattr__(self, "hysteresis", hysteresis)
        object.__setattr__(self, "min_scale", low)
        object.__setattr__(self, "max_scale", high)

    @property
    def is_default(self) -> bool:
        """Whether these are torch's rules (no hysteresis, no bounds): its fused update kernel."""
        return self.hysteresis == 1 and self.min_scale is None and self.max_scale is None

    def state(self) -> dict[str, int | float]:
        """The ``state_dict()`` keys of these bounds: only the fields off torch's rules.

        So a default scaler's state has torch's keys alone. A checkpoint's keys
        replace the scaler's bounds on ``load_state_dict`` (validated there).
        """
        out: dict[str, int | float] = {}
        if self.hysteresis != 1:
            out["hysteresis"] = self.hysteresis
        if self.min_scale is not None:
            out["min_scale"] = self.min_scale
        if self.max_scale is not None:
            out["max_scale"] = self.max_scale
        return out


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Layout:
    """What this rank declares about where its parameters live: ``layout=Layout(...)``.

    Args:
        distinct_dims: mesh dimension names whose coordinates hold different
            parameters (pipeline stages, e.g. ``("pp",)``); ``"*"`` marks plain
            tensors as distinct on every rank. Used by clipping and the spike
            test's norm to avoid double counting. A collection of names, never
            a bare string (``"pp"`` would mean ``{"p"}``).
        distinct_params: plain-tensor parameters that this rank holds its own
            of while the other plain parameters are replicated: the experts
            placed on this rank in a plain-tensor expert-parallel model (each
            rank passes its own). They count towards the norm on every rank;
            DTensor experts need nothing here (docs/moe.md). An iterator is
            read once, here. Not part of ``state_dict``; a pickled or
            deep-copied scaler refers to the copies of these parameters only
            when its model is copied with it.

    ``distinct_dims`` is kept sorted. Two layouts are equal when they name the
    same dims and the *same* tensors (by identity: parameters are compared as
    objects, never by value).
    """

    distinct_dims: tuple[str, ...] = ()
    distinct_params: tuple[torch.Tensor, ...] = ()

    def __post_init__(self) -> None:
        dims = check_distinct_dims(self.distinct_dims)
        params: object = self.distinct_params
        if isinstance(params, Iterable) and not isinstance(params, (torch.Tensor, str, bytes)):
            params = tuple(params)  # an iterator is read once, here
        distinct_param_ids(params)  # type: ignore[arg-type]  # refuses a tensor, str, non-tensor
        object.__setattr__(self, "distinct_dims", tuple(sorted(dims)))
        object.__setattr__(self, "distinct_params", params)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        mine, theirs = self.distinct_params, other.distinct_params
        return (
            self.distinct_dims == other.distinct_dims
            and len(mine) == len(theirs)
            and all(a is b for a, b in zip(mine, theirs, strict=True))
        )

    def __hash__(self) -> int:
        return hash((self.distinct_dims, tuple(map(id, self.distinct_params))))

    def __repr__(self) -> str:
        # Parameters are shown by shape: their values say nothing about the layout.
        shapes = ", ".join(str(tuple(p.shape)) for p in self.distinct_params[:4])
        more = ", ..." if len(self.distinct_params) > 4 else ""
        return (
            f"Layout(distinct_dims={self.distinct_dims!r}, distinct_params=<"
            f"{len(self.distinct_params)} tensor(s){': ' + shapes + more if shapes else ''}>)"
        )


@dataclass(frozen=True, slots=True)
class LossCheck:
    """Skip the step on every rank when any rank's loss is non-finite: ``policies=[LossCheck()]``.

    ``scale(loss)`` records whether the loss is finite (call
    ``scaler.observe_loss(loss)`` yourself where the loss is not scaled); the
    flag rides in the step's one all-reduce, no host read. Ranks that hold no
    loss (the first stages of a pipeline) add nothing. The reason is
    ``SkipReason.LOSS``; the scale does not back off.

    Its declarations follow the ``SkipPolicy`` protocol (name, code,
    precedence, slots); its flag is the engine's shared ``loss_nonfinite``
    slot, read in the step's fixed ops rather than through ``bind``.
    """

    name: ClassVar[str] = "loss"
    code: ClassVar[int] = 2  # SkipReason.LOSS
    precedence: ClassVar[int] = 20
    slots: ClassVar[tuple[str, ...]] = ()

    def fingerprint(self) -> str:
        """The options as text, compared across ranks (the step's declarations)."""
        return repr(self)


@dataclass(frozen=True, slots=True)
class SkipStreakLimit:
    """Stop every rank after ``max_skips`` consecutive skipped steps: ``policies=[SkipStreakLimit(N)]``.

    Once ``max_skips`` steps in a row were skipped (for any reason),
    ``update()`` raises :class:`~shardscale.core.SkipStreakError` on every rank
    at the same call. ``max_skips`` is an int in ``[1, 1_000_000]``; leave the
    policy out never to stop. The streak is in ``state_dict()``
    (``_skip_streak``, ``_skip_streak_reasons``).
    """

    max_skips: int

    def __post_init__(self) -> None:
        value = self.max_skips
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Integral)
            or not 1 <= int(value) <= MAX_STREAK
        ):
            raise ValueError(
                f"SkipStreakLimit(max_skips={value!r}): must be an int in [1, {MAX_STREAK}] (raise "
                "after that many skipped steps in a row); leave SkipStreakLimit out of policies "
                "never to stop"
            )
        object.__setattr__(self, "max_skips", int(value))


#: A skip policy option: what ``ShardedGradScaler(policies=[...])`` takes.
BuiltinPolicy: TypeAlias = SpikeSkip | LossCheck | SkipStreakLimit

_KINDS: tuple[type, ...] = (SpikeSkip, LossCheck, SkipStreakLimit)
_ACCEPTED = "SpikeSkip(...), LossCheck(), SkipStreakLimit(max_skips=N)"


@dataclass(frozen=True, slots=True)
class SplitPolicies:
    """The policies of one scaler, by kind (each ``None`` when absent), and as given."""

    given: tuple[Any, ...]
    spike: SpikeSkip | None
    loss: LossCheck | None
    streak: SkipStreakLimit | None
    #: Third-party policies (the ``SkipPolicy`` protocol), in the order given.
    plugins: tuple[object, ...] = ()


def split_policies(policies: object) -> SplitPolicies:
    """Check ``policies`` (an iterable of skip policy objects, at most one of each kind)."""
    if isinstance(policies, _KINDS):
        raise TypeError(
            f"policies takes a list of skip policies, got a single {type(policies).__name__}; "
            f"write policies=[{policies!r}]"
        )
    if isinstance(policies, (str, bytes)) or not isinstance(policies, Iterable):
        raise TypeError(
            f"policies takes a list of skip policies ({_ACCEPTED}), got "
            f"{type(policies).__name__} {policies!r}; pass policies=() for none"
        )
    given = tuple(policies)  # an iterator is read once, here
    found: dict[type, BuiltinPolicy] = {}
    plugins: list[object] = []
    for policy in given:
        kind = next((k for k in _KINDS if isinstance(policy, k)), None)
        if kind is None:
            if isinstance(policy, type) or hasattr(policy, "name"):
                plugins.append(policy)  # a third-party policy: check_policies names any problem
                continue
            raise TypeError(
                f"policies holds a {type(policy).__name__} ({policy!r}); it takes skip policy "
                f"objects: {_ACCEPTED}, or a third-party SkipPolicy"
            )
        if kind in found:
            raise ValueError(
                f"policies holds two {kind.__name__} policies ({found[kind]!r} and {policy!r}); "
                f"pass at most one of each kind"
                + (
                    " (one SpikeSkip combines its tests: SpikeSkip(max_norm_abs=..., z=..., "
                    "ratio=...))"
                    if kind is SpikeSkip
                    else ""
                )
            )
        found[kind] = policy
    spike, loss, streak = (found.get(k) for k in _KINDS)
    assert spike is None or isinstance(spike, SpikeSkip)
    assert loss is None or isinstance(loss, LossCheck)
    assert streak is None or isinstance(streak, SkipStreakLimit)
    return SplitPolicies(given=given, spike=spike, loss=loss, streak=streak, plugins=tuple(plugins))


def check_loss_scaling_option(value: object) -> ScaleBounds | None:
    """``loss_scaling``: ``True`` -> ``ScaleBounds()``, a ``ScaleBounds`` as is, ``False`` -> None."""
    if value is True:
        return ScaleBounds()
    if value is False:
        return None
    if isinstance(value, ScaleBounds):
        return value
    raise TypeError(
        f"loss_scaling must be True (fp16: torch's dynamic loss scaling), a ScaleBounds(...) "
        f"(dynamic scaling with hysteresis/min_scale/max_scale) or False (bf16/fp32: the scale "
        f"stays 1, non-finite gradients still skip the step), got {type(value).__name__} "
        f"{value!r}"
    )


def declared_options(bounds: ScaleBounds | None, policies: SplitPolicies) -> str:
    """The scaler's options that every rank must share, as text for the step's declarations.

    Ranks whose spike test or streak limit differ would take different
    verdicts from the same reduced vector; ranks whose scale bounds differ
    would drift apart in scale. Field values are normalised by each object's
    ``__post_init__``, so equal options give equal text.
    """
    scaling = "False" if bounds is None else repr(bounds)
    return f"loss_scaling={scaling}, spike={policies.spike!r}, streak={policies.streak!r}"


# -- the keywords that moved into option objects -----------------------------------------------

_SCALE_KEYWORDS = ("hysteresis", "min_scale", "max_scale")
_LAYOUT_KEYWORDS = ("distinct_dims", "distinct_params")


def _moved_policy(name: str, value: object) -> str | None:
    """``policies=[...]`` text for one moved policy keyword, or None when it asked for nothing."""
    if name == "spike":
        return None if value is None else repr(value)
    if name == "max_consecutive_skips":
        return None if value is None else f"SkipStreakLimit(max_skips={value!r})"
    # check_loss
    return "LossCheck()" if value else None


def moved_keywords_error(kwargs: dict[str, Any], *, owner: str) -> TypeError | None:
    """The error for keywords ``owner`` no longer takes, naming what replaced each, or None.

    ``kwargs`` are the keywords as called; none of them is acted on.
    """
    fixes: list[str] = []
    scale = {k: kwargs[k] for k in _SCALE_KEYWORDS if k in kwargs}
    if scale:
        fields = ", ".join(f"{k}={v!r}" for k, v in scale.items())
        fixes.append(
            f"{'=, '.join(scale)}= moved: pass loss_scaling=ScaleBounds({fields}) "
            "(from shardscale.core import ScaleBounds)"
        )
    layout = {k: kwargs[k] for k in _LAYOUT_KEYWORDS if k in kwargs}
    if layout:
        fields = ", ".join(
            f"{k}={v!r}" if k == "distinct_dims" else f"{k}=[...]" for k, v in layout.items()
        )
        fixes.append(
            f"{'=, '.join(layout)}= moved: pass layout=Layout({fields}) "
            "(from shardscale.core import Layout)"
        )
    moved = [k for k in ("spike", "check_loss", "max_consecutive_skips") if k in kwargs]
    if moved:
        items = [t for t in (_moved_policy(k, kwargs[k]) for k in moved) if t is not None]
        where = (
            f"pass policies=[{', '.join(items)}]" if items else "drop it (the default is no policy)"
        )
        fixes.append(
            f"{'=, '.join(moved)}= moved into skip policy objects: {where} (from "
            "shardscale.core import SpikeSkip, LossCheck, SkipStreakLimit)"
        )
    if "registry" in kwargs:
        fixes.append(
            "registry= was removed: the scaler uses the process registry; register an "
            "in-process plugin there with shardscale.core.get_registry().register(plugin, "
            "name=...) and unregister it when done"
        )
    if not fixes:
        return None
    return TypeError(f"{owner}: " + "; ".join(fixes) + " (docs/migration.md)")


def refuse_moved_keywords(init: Callable[P, None]) -> Callable[P, None]:
    """Wrap ``ShardedGradScaler.__init__`` so a keyword that moved raises, naming its replacement.

    Python's own error for an unknown keyword says only that it is unexpected.
    The check runs before the constructor, so nothing is built; the signature
    (``inspect.signature``, type checkers) stays the wrapped one.
    """

    @functools.wraps(init)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        error = moved_keywords_error(kwargs, owner="ShardedGradScaler()")
        if error is not None:
            raise error
        init(*args, **kwargs)

    return wrapper
