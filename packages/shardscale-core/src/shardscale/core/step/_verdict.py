"""The step's verdict: take the optimizer step, or skip it and say why.

[Note: the verdict]
Every reason to skip a step is a pure function of the step's reduced vector
and of state that lives on the device and is identical on every rank, so it
costs no collective and no host read:

* **error**: a rank failed or ranks disagree (the engine raises too);
* **non-finite gradient**: any local gradient on any rank held inf/nan --
  an fp16 *overflow* under loss scaling, *non-finite* without it (bf16/fp32);
* **non-finite loss**: a rank observed a non-finite loss
  (``ShardedGradScaler(policies=[LossCheck()])`` or ``observe_loss``); the vector's
  shared ``loss_nonfinite`` value, to which ranks without a loss add 0;
* **spike**: the step's global pre-clip norm is finite but above
  :class:`SpikeSkip`'s absolute threshold, or far above the rolling window of
  recently *accepted* norms. The window is fed from the reduced norm after the
  verdict, so it is the same on every rank without a collective.

When several apply, the reason is the first in that order (error, then
non-finite gradient, then non-finite loss, then spike): :class:`SkipReason`'s
values grow with precedence, so the reason is a maximum. Only a non-finite
gradient backs the loss scale off; a step skipped for its loss or a spike
leaves the scale alone and counts for growth as a clean step (its gradients
were finite at this scale, which is what the growth interval measures).
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from shardscale.core._errors import SkipStreakError
from shardscale.core.step._host_copy import HostCopy

if TYPE_CHECKING:
    from shardscale.core.step._policy import BoundPolicies

__all__ = [
    "SkipReason",
    "SkipStreak",
    "SpikeSkip",
    "SpikeWindow",
    "Verdict",
]


class SkipReason(enum.IntEnum):
    """Why a step was skipped; ``NONE``: it was taken.

    The value grows with precedence: when several reasons apply, the step's
    reason is the largest (error, then non-finite gradient, then non-finite
    loss, then spike). ``scaler.last_skip_reason`` and
    ``StepRecord.skip_reason`` hold the value as a 0-dim int64 device tensor:
    ``SkipReason(int(t))`` names it (a host read).
    """

    #: The step was taken.
    NONE = 0
    #: The global pre-clip gradient norm was a spike (:class:`SpikeSkip`).
    SPIKE = 1
    #: A rank observed a non-finite loss (``LossCheck()`` / ``observe_loss``).
    LOSS = 2
    #: A non-finite gradient on some rank without loss scaling (``loss_scaling=False``).
    NONFINITE = 3
    #: A non-finite gradient on some rank under loss scaling: the scale backs off.
    OVERFLOW = 4
    #: A rank failed in the step or ranks disagreed; every rank raises as well.
    ERROR = 5


def _number(value: object, name: str, *, low: float, strict: bool, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"SpikeSkip({name}=...) takes a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number) or number < low or (strict and number == low):
        bound = f"> {low:g}" if strict else f">= {low:g}"
        raise ValueError(f"SpikeSkip({name}={value!r}): must be a finite number {bound}{fix}")
    return number


#: The largest ``SpikeSkip`` ``window`` and ``warmup``. [Note: the spike options' range]
#: What a spike test holds grows with them: the ring of accepted norms is (reasons x window)
#: float64 on the device, and the coefficient tables (``SpikeWindow._coefficients``) have
#: ``max(window, warmup) + 1`` float64 entries each, built by a host loop at the first step
#: and rebuilt on every load. At 2**16 that is 3 MiB of ring, 1 MiB of tables and 0.2-0.4 s
#: once (measured on a loaded 2-core CPU host); ``warmup=10**7`` (accepted before this bound)
#: took 12 s and 160 MiB, larger values minutes and GBs. 65536 accepted steps of window or
#: warmup are 500 times the window of OLMo-core's recipe (128), which the default follows.
MAX_SPIKE_STEPS = 2**16


def _count(value: object, name: str, *, low: int, fix: str) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or not low <= int(value) <= MAX_SPIKE_STEPS
    ):
        raise ValueError(
            f"SpikeSkip({name}={value!r}): must be an int in [{low}, {MAX_SPIKE_STEPS}] "
            f"(the window's memory and the first step's time grow with it){fix}"
        )
    return int(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class SpikeSkip:
    """Skip a step whose global gradient norm is a spike (``policies=[SpikeSkip(...)]``).

    The norm is the true global pre-clip norm of the step: the clip call's
    (``unscale_and_clip_``/``unscale_(..., max_norm=...)``, of its
    ``norm_type``), or, when the step is not clipped, the 2-norm the step engine
    computes in the step's one read and one all-reduce. A step is a spike when
    its norm is finite and any enabled test says so:

    * ``max_norm_abs``: the norm exceeds it (an absolute threshold, as
      Megatron-LM's ``grad_norm_skip_threshold``); armed from the first step;
    * ``z``: the norm exceeds ``mean + z * std`` of the window (unbiased std;
      one-sided: a norm far *below* the window is not a spike);
    * ``ratio``: the norm exceeds ``ratio * mean`` of the window.

    The window holds the norms of the last ``window`` *accepted* steps (steps
    taken by the optimizer), on the device. The relative tests (``z``,
    ``ratio``) arm once ``warmup`` steps have been accepted; ``None`` means
    OLMo-core's rule, ``max(2, window // 2 - 1)`` (OLMo-core tests a norm once
    its history *with* that norm holds ``max(2, window // 2)`` values). ``SpikeSkip()`` is OLMo-core's
    default: 6 standard deviations over the last 128 accepted steps. Pass
    ``z=None`` to use only the other tests. ``window`` and ``warmup`` are at
    most 65536 (what the test holds and its first step's time grow with
    them).
    """

    #: Its declarations as a skip policy (see [Note: a skip policy] in ``_policy``): the
    #: engine keeps its flag's fused place (no slots: it flags from the step's global norm).
    name: ClassVar[str] = "spike"
    code: ClassVar[int] = 1  # SkipReason.SPIKE
    precedence: ClassVar[int] = 10
    slots: ClassVar[tuple[str, ...]] = ()

    max_norm_abs: float | None = None
    z: float | None = 6.0
    ratio: float | None = None
    window: int = 128
    warmup: int | None = None

    def __post_init__(self) -> None:
        # Each field is stored as its checked int or float: equal policies show (and so
        # fingerprint, in the step's declarations) the same, SpikeSkip(z=6) as SpikeSkip(z=6.0).
        if self.max_norm_abs is not None:
            number = _number(self.max_norm_abs, "max_norm_abs", low=0.0, strict=True, fix="")
            object.__setattr__(self, "max_norm_abs", number)
        if self.z is not None:
            number = _number(
                self.z, "z", low=0.0, strict=True, fix="; None turns the z-score test off"
            )
            object.__setattr__(self, "z", number)
        if self.ratio is not None:
            number = _number(
                self.ratio, "ratio", low=1.0, strict=True, fix="; None turns the ratio test off"
            )
            object.__setattr__(self, "ratio", number)
        if self.max_norm_abs is None and self.z is None and self.ratio is None:
            raise ValueError(
                "SpikeSkip(max_norm_abs=None, z=None, ratio=None) tests nothing: set at least "
                "one of them (SpikeSkip() uses z=6.0)"
            )
        window = _count(self.window, "window", low=2, fix=" (the window needs two norms for a std)")
        object.__setattr__(self, "window", window)
        if self.warmup is not None:
            # A std needs two values; a mean one.
            low = 2 if self.z is not None else 1
            warmup = _count(
                self.warmup, "warmup", low=low, fix="; None means max(2, window // 2 - 1)"
            )
            object.__setattr__(self, "warmup", warmup)

    def fingerprint(self) -> str:
        """The options as text, compared across ranks (the step's declarations)."""
        return repr(self)

    @property
    def armed_after(self) -> int:
        """How many accepted steps the relative tests wait for."""
        return self.warmup if self.warmup is not None else max(2, self.window // 2 - 1)


class SpikeWindow:
    """The rolling window of accepted norms, on the device: a ring buffer and a count.

    Fed by :meth:`accept` after each verdict, so every rank holds the same
    window. Until :meth:`materialize` places it on a device (beside the
    scale), its content lives on the host (a checkpoint loaded before the
    first step).

    [Note: the spike window in few ops]
    The ring is row 0 of a (reasons x window) buffer and the count entry 0 of a
    per-reason counter: :meth:`accept` writes the norm at row ``reason``, column
    ``count % window``, and adds 1 to counter ``reason``, so a skipped step
    writes into a row nobody reads and no ``where`` picks the row (three ops).
    The statistics are one ``var_mean`` over the whole ring, whose unfilled
    slots are 0, turned into the held values' mean and unbiased variance with
    coefficients looked up by the count (:meth:`_tables`: ``w / n`` and
    ``z * sqrt(w / (n - 1))``, or a threshold of inf before the warmup):
    with ``m``, ``v`` the ring's mean and biased variance, the ``n`` held
    values have mean ``(w/n) m`` and ``Σ (x - mean)^2 = w (v + m^2 - (w/n) m^2)``.
    """

    __slots__ = (
        "_abs",
        "_host",
        "_one",
        "_rows",
        "_tables",
        "_tested",
        "buffer",
        "count",
        "policy",
    )

    def __init__(self, policy: SpikeSkip) -> None:
        self.policy = policy
        self.buffer: torch.Tensor | None = None
        self.count: torch.Tensor | None = None
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None  # ring rows, counters
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._tested: torch.Tensor | None = None  # the last norm is_spike tested, float64
        self._host: tuple[list[float], int] = ([], 0)
        # The window's own constants (see [Note: whose scratch] in _arith).
        self._abs: torch.Tensor | None = None
        self._one: torch.Tensor | None = None

    def materialize(self, device: torch.device) -> None:
        """Create the device tensors from the host content (once, beside the scale)."""
        if self.buffer is not None:
            return
        values, count = self._host
        size = self.policy.window
        rows = torch.zeros(len(SkipReason), size, dtype=torch.float64)
        # The i-th of the last n accepted norms sits where the ring put it: (count - n + i) % size.
        for i, value in enumerate(values):
            rows[0, (count - len(values) + i) % size] = value
        counters = torch.zeros(len(SkipReason), dtype=torch.int64)
        counters[0] = count
        self._rows = (rows.to(device), counters.to(device))
        self.buffer, self.count = self._rows[0][0], self._rows[1][0]
        self._tables = self._coefficients(device)
        self._one = torch.ones((), dtype=torch.int64, device=device)
        if self.policy.max_norm_abs is not None:
            self._abs = torch.tensor(self.policy.max_norm_abs, dtype=torch.float64).to(device)

    def _coefficients(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Indexed by min(count, last): the held count is min(count, window), armed from
        # armed_after on; ``last`` is the first count at which both are settled.
        policy, size = self.policy, self.policy.window
        last = max(size, policy.armed_after)
        mean_of, spread_of = [], []
        for count in range(last + 1):
            held = min(count, size)
            armed = count >= policy.armed_after and held >= 1
            mean_of.append(size / held if armed else math.inf)
            z = policy.z if policy.z is not None else 0.0
            spread_of.append(z * math.sqrt(size / (held - 1)) if armed and held > 1 else 0.0)
        return (
            torch.tensor(mean_of, dtype=torch.float64).to(device),
            torch.tensor(spread_of, dtype=torch.float64).to(device),
        )

    def is_spike(self, norm: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Whether ``norm`` (0-dim) is a spike, into ``out`` if given: no host read.

        The tests combine into one threshold (a norm above the smallest is above one of
        them). A nan norm is never a spike; an inf one is, which changes nothing: its step
        is skipped for its non-finite gradient, the stronger reason.
        """
        assert self.buffer is not None and self.count is not None and self._tables is not None
        policy = self.policy
        # What accept() puts in the window if the step is taken (the engine passes float64).
        self._tested = norm if norm.dtype is torch.float64 else norm.to(torch.float64)
        threshold: torch.Tensor | float = math.inf
        if policy.z is not None or policy.ratio is not None:
            mean_of, spread_of = self._tables
            at = self.count.clamp(max=mean_of.numel() - 1)
            var, ring_mean = torch.var_mean(self.buffer, correction=0)
            # Before the warmup the factor is inf: the threshold is inf (or nan: no spike).
            mean = torch.take(mean_of, at) * ring_mean
            limits = []
            if policy.z is not None:
                spread = torch.addcmul(var, ring_mean, ring_mean)
                # Rounding can take an all-equal window's spread a hair below 0.
                spread = torch.addcmul(spread, mean, ring_mean, value=-1.0).clamp_(min=0.0)
                limits.append(torch.addcmul(mean, torch.take(spread_of, at), spread.sqrt()))
            if policy.ratio is not None:
                limits.append(policy.ratio * mean)
            threshold = limits[0] if len(limits) == 1 else torch.minimum(*limits)
        if policy.max_norm_abs is not None:
            if isinstance(threshold, torch.Tensor):
                # fmin: an unarmed (nan) relative threshold leaves the absolute one.
                assert self._abs is not None
                threshold = torch.fmin(threshold, self._abs)
            else:
                threshold = policy.max_norm_abs
        if out is None:
            return norm > threshold
        return torch.gt(norm, threshold, out=out)

    def accept(self, reason: torch.Tensor) -> None:
        """Put the norm :meth:`is_spike` last tested (the step's global norm, in float64) in the
        window if the step was taken (its 0-dim ``reason`` is ``SkipReason.NONE``): three device
        ops, see [Note: the spike window in few ops]."""
        assert self._rows is not None and self.count is not None
        if self._tested is None:  # no step of this scaler tested a norm yet
            return
        rows, counters = self._rows
        at = self.count.remainder(self.policy.window)
        rows.index_put_((reason, at), self._tested)
        assert self._one is not None
        counters.index_put_((reason,), self._one, accumulate=True)

    def state(self) -> tuple[list[float], int]:
        """The accepted norms held, oldest first, and how many were accepted (a host read)."""
        if self.buffer is None or self.count is None:
            return list(self._host[0]), self._host[1]
        count = int(self.count.item())
        size = self.policy.window
        held = min(count, size)
        ring: list[float] = self.buffer.tolist()
        return [ring[(count - held + i) % size] for i in range(held)], count

    def load(self, values: list[float], count: int) -> None:
        """Replace the content (validated by :func:`validate_spike_state`)."""
        values = values[-self.policy.window :]
        if len(values) < min(count, self.policy.window):
            # Resumed into a larger window: only the norms saved were accepted into this one;
            # counting the rest would read the empty slots as accepted norms of 0.
            count = len(values)
        self._host = (list(values), count)
        if self.buffer is not None:
            device = self.buffer.device
            self.buffer = self.count = None
            self._rows = None
            self.materialize(device)


def validate_spike_state(state: Mapping[str, Any]) -> tuple[list[float], int] | None:
    """A checkpoint's spike window (``spike_window``, ``spike_accepted``), or None if it has none."""
    if "spike_window" not in state and "spike_accepted" not in state:
        return None
    values, count = state.get("spike_window"), state.get("spike_accepted")
    if not isinstance(values, (list, tuple)) or not all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) for v in values
    ):
        raise ValueError(
            "scaler state dict key 'spike_window' must be a list of finite numbers (the accepted "
            f"norms, oldest first), got {values!r}; save the state with scaler.state_dict()"
        )
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < len(values):
        raise ValueError(
            f"scaler state dict key 'spike_accepted' must be an int >= len(spike_window) "
            f"({len(values)}), got {count!r}; save the state with scaler.state_dict()"
        )
    return [float(v) for v in values], int(count)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a step engine call needs to give its verdict beyond found_inf (the scaler's policies)."""

    #: The reason a non-finite gradient gives: OVERFLOW under loss scaling, else NONFINITE.
    nonfinite_reason: SkipReason = SkipReason.NONFINITE
    #: The spike test's window, or None.
    spike: SpikeWindow | None = None
    #: The policies as text, for the step's declarations fingerprint: ranks whose policies
    #: differ would take different verdicts on the same reduced vector, so they all raise.
    declared: str = ""
    #: The scaler's third-party skip policies, bound to its device (see ``_policy``), or None.
    policies: BoundPolicies | None = None


class SkipStreak:
    """Counts consecutive skipped steps on the device; raises :class:`SkipStreakError` at a limit.

    [Note: the streak read one step late]
    After each ``update()`` the streak and the reasons seen in it (a bit mask)
    are copied to the host asynchronously. Off the GPU the copy is done at
    once and ``update()`` raises right away. On a GPU it is read at the
    scaler's next call (a step or ``update()``), waiting only for the previous
    update's few bytes while this step's work is already queued: every rank
    raises at the same call, before the next step's collective, so no rank
    waits for a peer that stopped.
    """

    __slots__ = ("_copy", "_initial", "_step", "count", "limit", "mask")

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.count: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self._copy: HostCopy | None = None
        self._step = 0
        self._initial = (0, 0)  # (streak, reasons mask) until materialized

    def materialize(self, device: torch.device) -> None:
        """Create the device counters (once, beside the scale)."""
        if self.count is None:
            count, mask = self._initial
            self.count = torch.tensor(count, dtype=torch.int64, device=device)
            self.mask = torch.tensor(mask, dtype=torch.int64, device=device)

    def load(self, count: int, mask: int) -> None:
        """Restore a checkpoint's streak."""
        self._initial = (count, mask)
        if self.count is not None and self.mask is not None:
            self.count.fill_(count)
            self.mask.fill_(mask)

    def after_update(self, skipped: torch.Tensor, reason: torch.Tensor, *, step: int) -> None:
        """Advance the streak with this update's verdict; raise now if the limit is known reached."""
        if self.limit is None:
            return  # nothing to stop: no device work for the default scaler
        assert self.count is not None and self.mask is not None
        self.count.copy_(torch.where(skipped, self.count + 1, 0))
        bit = torch.ones((), dtype=torch.int64, device=reason.device) << reason
        self.mask.copy_(torch.where(skipped, self.mask | bit, 0))
        self._copy = HostCopy(torch.stack([self.count, self.mask]))
        self._step = step
        if not self._copy.on_device:
            self.check()

    def check(self) -> None:
        """Raise if the last update's streak reached the limit (waits for its copy, if any)."""
        copy, self._copy = self._copy, None
        if copy is None or self.limit is None:
            return
        values = copy.read()
        assert values is not None  # read() waits
        count, mask = (int(v) for v in values)
        if count < self.limit:
            return
        reasons = tuple(r for r in SkipReason if r and mask & (1 << r))
        # A third-party skip policy's code (16..62) is named by its number.
        plugin = [f"code {c}" for c in range(16, 63) if mask & (1 << c)]
        names = ", ".join([r.name.lower() for r in reasons] + plugin)
        first = self._step - count + 1
        raise SkipStreakError(
            f"{count} consecutive optimizer steps were skipped (scaler steps {first} to "
            f"{self._step}; reasons: {names}), reaching SkipStreakLimit(max_skips={self.limit}), "
            "so every rank stops here. Look at the data and the learning rate around step "
            f"{first} (scaler.overflow_report(model) names non-finite gradients); raise "
            "max_skips, or leave SkipStreakLimit out of policies never to stop",
            step=self._step,
            streak=count,
            reasons=reasons,
        )

    def state(self) -> tuple[int, int]:
        """The current streak and its reasons mask (a host read, for checkpoints)."""
        if self.count is None or self.mask is None:
            return self._initial
        count, mask = torch.stack([self.count, self.mask]).tolist()
        return int(count), int(mask)
