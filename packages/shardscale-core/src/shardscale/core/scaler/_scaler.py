"""ShardedGradScaler: dynamic loss scaling whose skip/step decision is identical on every rank.

[Note: parity with torch.amp.GradScaler]
With default options the arithmetic is torch's own: gradients are unscaled by
``torch._amp_foreach_non_finite_check_and_unscale_`` with the same
``inv_scale`` (the float64 reciprocal of the scale, rounded to float32), and
the scale moves through ``torch._amp_update_scale_``. The per-optimizer state
machine (READY → UNSCALED → STEPPED, reset by ``update``) and the errors for
misuse follow torch's. What differs is only *where* found_inf comes from:
every path into ``step`` -- ``unscale_``, ``unscale_(..., max_norm=...)``, a
fused optimizer's check without ``unscale_`` -- is one call of the step engine
(``shardscale.core.step._engine``, [Note: one step, top to bottom]), which
reads every local gradient and reduces in ONE collective over the scaler's
process group, so every rank decides the same way whatever layout its
parameters have. This module keeps the state machine and the scale.

[Note: options beyond torch]
torch's seven arguments stay as they are; everything else is one of six
keyword options, the families among them frozen objects (see [Note: the
scaler's options] in ``_options``). ``loss_scaling=ScaleBounds(...)`` (hysteresis,
min/max scale) is off by default; with it, the update runs as tensor arithmetic
on the scale's device (no host sync) instead of torch's fused update kernel.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
import weakref
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, overload

import torch
from torch.amp.grad_scaler import OptState

from shardscale.core._eager import eager
from shardscale.core._errors import DeclarationError
from shardscale.core._protocols import AdapterContext, CollectiveBackend, StepRecord
from shardscale.core._registry import Registry, get_registry
from shardscale.core.scaler._optimizer_fusion import (
    PASSING,
    FusionChecks,
    fused_kernel_step,
    step_hooks,
    unfold_gradients_,
)
from shardscale.core.scaler._options import (
    BuiltinPolicy,
    Layout,
    LossCheck,
    ScaleBounds,
    SkipStreakLimit,
    check_loss_scaling_option,
    declared_options,
    refuse_moved_keywords,
    split_policies,
)
from shardscale.core.scaler._overflow import OverflowReport, build_overflow_report
from shardscale.core.scaler._values import (
    DEFAULT_INIT_SCALE,
    FLOAT32_TINY,
    ScalerStateError,
    scale_floor,
    validate_backoff_factor,
    validate_fixed_scale_options,
    validate_growth_factor,
    validate_growth_interval,
    validate_init_scale,
    validate_scale,
    validate_state_dict,
)
from shardscale.core.step import (
    Apply,
    PrecomputedNorms,
    StepConfig,
    StepPlans,
    StepRequest,
    StepResult,
    poll_errors,
    run_step,
)
from shardscale.core.step._buckets import optimizer_params
from shardscale.core.step._clip import clip_parameters_
from shardscale.core.step._contract import (
    check_kernels,
    check_max_norm,
    check_norm_type,
    distinct_param_ids,
    kernels_name,
)
from shardscale.core.step._policy import BoundPolicies, SkipPolicy, check_policies
from shardscale.core.step._verdict import (
    SkipReason,
    SkipStreak,
    SpikeSkip,
    SpikeWindow,
    Verdict,
    validate_spike_state,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# ScalerStateError is defined in _scaler_values and re-exported here.
__all__ = ["OptState", "ShardedGradScaler", "ScalerStateError"]


class _OptimizerState(dict[str, Any]):
    """torch's per-optimizer record, ``{"stage": OptState, "found_inf_per_device": {...}}``.

    Code written against torch reads ``scaler._per_optimizer_states[id(opt)]["stage"]``
    (comparing with torch's own ``OptState``) and ``["found_inf_per_device"]``,
    so the container keeps that shape; after a step the per-device flags hold
    the *reduced* decision, never a rank-local one. ``grad_scale`` is what a
    fused optimizer divides by after ``unscale_(..., max_norm=...)`` left its
    gradients scaled.
    """

    __slots__ = ("_verdict_skip", "folded", "grad_scale", "overflow", "pending", "reason")

    def __init__(self) -> None:
        super().__init__(stage=OptState.READY, found_inf_per_device={})
        self.grad_scale: torch.Tensor | None = None
        #: The apply was left to torch's fused kernel for this unfused optimizer (its
        #: gradients are still scaled): ``step`` must run it fused.
        self.folded = False
        self.pending: StepResult | None = None
        #: The step's non-finite-gradient flag (what backs the scale off) and its SkipReason;
        #: ``found_inf_per_device`` holds the verdict the optimizer obeys (any reason).
        self.overflow: torch.Tensor | None = None
        self.reason: torch.Tensor | None = None
        self._verdict_skip: torch.Tensor | None = None

    def __getitem__(self, key: str) -> Any:
        if key == "found_inf_per_device":
            self.settle()  # whoever reads the flags sees the reduced decision
        return super().__getitem__(key)

    def settle(self) -> None:
        """Wait for a lazily issued reduction and raise if any rank failed in it."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait().raise_errors()

    @property
    def stage(self) -> OptState:
        """READY, UNSCALED or STEPPED in this iteration."""
        stage: OptState = self["stage"]
        return stage

    @stage.setter
    def stage(self, value: OptState) -> None:
        self["stage"] = value

    def record_verdict(self, result: StepResult) -> None:
        """Store a step's verdict: the skip flag the optimizer obeys, the overflow, the reason."""
        skip = result.skip if result.skip is not None else result.found_inf
        self["found_inf_per_device"] = {skip.device: skip}
        self._verdict_skip = skip if result.skip is not None else None
        self.overflow, self.reason = result.found_inf, result.skip_reason

    def record(self, result: StepResult, grad_scale: torch.Tensor | None) -> None:
        """Store a step's reduced decision; the optimizer is UNSCALED from now on."""
        self.record_verdict(result)
        self.grad_scale = grad_scale
        self.stage = OptState.UNSCALED
        self.pending = result if result.is_pending else None

    def found_inf(self, device: torch.device) -> torch.Tensor | None:
        """The flags summed on ``device`` and capped at 1 (fused optimizers skip only at 1)."""
        flags: list[torch.Tensor] = list(self["found_inf_per_device"].values())
        if not flags:
            return None
        if len(flags) == 1 and flags[0] is self._verdict_skip and flags[0].device == device:
            return flags[0]  # the engine's own verdict: already one 0-dim float32 0/1 flag
        total = torch.zeros((), dtype=torch.float32, device=device)
        for flag in flags:
            total = total + flag.to(device, non_blocking=True).reshape(())
        return total.clamp(max=1.0)


def _nonfinite_per_rank(
    iteration: list[tuple[weakref.ref[torch.optim.Optimizer], StepResult]],
) -> torch.Tensor | None:
    # Each engine step's reduced vector already holds every rank's count of non-finite
    # gradients (see [Note: localisation rides on the step's read]): a slice, no host read.
    counts = [
        r.nonfinite_block
        if r.nonfinite_block is not None
        else r.vector[r.layout.block("nonfinite")]
        for _, r in iteration
    ]
    if not counts or len({c.shape for c in counts}) != 1:
        return None
    return counts[0] if len(counts) == 1 else torch.stack(counts).sum(dim=0)


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # A Python check, not a no-op .to(): each dispatched op is host time on every step.
    return tensor if tensor.device == device else tensor.to(device, non_blocking=True)


def _strongest(flags: list[torch.Tensor]) -> torch.Tensor:
    """The largest of 0-dim tensors (any skip, any overflow, the strongest reason)."""
    return flags[0] if len(flags) == 1 else torch.stack(flags).amax()


def _bad_fuse_option(value: object, *, per_call: bool = True) -> TypeError | None:
    """The error for a ``fuse_optimizer`` that is not True or False (1 and 0 included).

    Per call, ``None`` means the scaler's choice; the scaler's own option no
    longer takes it (it meant "fold after unscale_and_clip_ only").
    """
    if isinstance(value, bool) or (per_call and value is None):
        return None
    if value is None:
        return TypeError(
            "ShardedGradScaler(fuse_optimizer=None) is gone: None folded the apply into torch's "
            "fused kernel after unscale_and_clip_ by default. The default is now False, which "
            "steps exactly the optimizer you built (torch's numbers); pass fuse_optimizer=True "
            "for the sync-free path through torch's fused kernel, or build the optimizer with "
            "fused=True"
        )
    if not per_call:
        return TypeError(f"fuse_optimizer must be True or False, got {value!r}")
    return TypeError(f"fuse_optimizer must be None, True or False, got {value!r}")


class ShardedGradScaler:
    """Dynamic loss scaling for sharded and unsharded models.

    A drop-in for :class:`torch.amp.GradScaler` and
    :class:`torch.distributed.fsdp.ShardedGradScaler`: the same constructor
    arguments, methods, state machine, errors and ``state_dict`` keys, and the
    same numbers (bit-identical parameters and scale trajectory in one process).
    In a distributed run the overflow decision is reduced across every rank in
    one collective per ``step``, for any mix of FSDP2/FSDP1/DDP/TP parameters.

    Args:
        device: device type of the scale (``"cuda"``, ``"cpu"``, ...). As in
            torch, ``"cuda"`` without CUDA warns and disables the scaler.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as
            in :class:`torch.amp.GradScaler`.
        process_group: the group every rank's overflow flag is reduced over
            (default: the default group). It must contain every rank holding
            parameters of the optimizers this scaler steps.
        backend: collective backend spec such as ``"c10d"`` or
            ``"counting+coalescing+c10d"``, or a backend object. Default:
            ``$SHARDSCALE_BACKEND``, else automatic.
        kernels: name of the stats kernels to use (default: best per device).
        layout: a :class:`~shardscale.core.Layout` declaring which parameters
            differ across ranks: ``distinct_dims`` (mesh dimension names whose
            coordinates hold different parameters, such as pipeline stages;
            ``"*"``: plain tensors are distinct on every rank) and
            ``distinct_params`` (this rank's own plain-tensor experts). Used
            by clipping and the spike test's norm to avoid double counting.
            Default: none (``Layout()``).
        policies: skip policies beyond the non-finite gradient guard, at most
            one of each kind (docs/skipped-steps.md):
            :class:`~shardscale.core.SpikeSkip` skips steps whose global
            gradient norm is a spike (its window of accepted norms is in
            ``state_dict()``; one optimizer per iteration);
            :class:`~shardscale.core.LossCheck` makes ``scale(loss)`` record
            whether the loss is finite, a non-finite loss on any rank skipping
            the step on every rank (see :meth:`observe_loss`);
            :class:`~shardscale.core.SkipStreakLimit` raises
            :class:`~shardscale.core.SkipStreakError` on every rank after that
            many consecutive skipped steps (for any reason); and third-party
            :class:`~shardscale.core.SkipPolicy` objects (from a plugin
            distribution), each adding slots to the step's one
            all-reduce and a flag to the verdict, with its own reason code and
            precedence ("Writing a skip policy" in docs/skipped-steps.md).
        loss_scaling: ``True`` (default): torch's dynamic loss scaling;
            a :class:`~shardscale.core.ScaleBounds`: dynamic scaling with
            hysteresis and bounds; ``False`` for bf16/fp32 training: the scale
            stays 1 (``scale(loss)`` returns the loss unchanged, ``update()``
            neither grows nor backs off) and a non-finite gradient on any rank
            still skips the step on every rank. Scaling options other than the
            defaults are refused then.
        fuse_optimizer: ``False`` (default): step exactly the optimizer the
            user built. ``True`` (the sync-free path): run an unfused torch
            SGD/Adam/AdamW step through torch's fused kernel, which takes the
            unscale and clip factor (``grad_scale``) and the skip
            (``found_inf``) inside its own pass: one gradient pass and the
            unfused step's host sync fewer (docs/step-engine.md, "the apply
            folded into the optimizer"); raising on every rank, naming why,
            when the optimizer does not qualify. The result differs from the
            foreach step at rounding level. The gradients then stay scaled
            between ``unscale_and_clip_`` and ``step`` (as for a fused
            optimizer); the kernel writes them back unscaled, except on a
            skipped step, which leaves them as they were. A step with step
            hooks registered (or momentum SGD's first) multiplies instead:
            hooks see what torch's recipe shows them. An optimizer built with
            ``fused=True`` needs neither: it takes ``grad_scale`` itself.
    """

    _device: str
    _enabled: bool
    _init_scale: float
    _growth_factor: float
    _backoff_factor: float
    _growth_interval: int
    _init_growth_tracker: int
    _hysteresis: int
    _init_hysteresis_tracker: int
    _min_scale: float | None
    _max_scale: float | None
    process_group: ProcessGroup | None
    _layout: Layout
    _distinct_dims: frozenset[str]
    _distinct_params: frozenset[int]
    _kernels_name: str | None
    _backend_spec: str | CollectiveBackend | None
    _backend: CollectiveBackend | None
    _scale: torch.Tensor | None
    _growth_tracker: torch.Tensor | None
    _hysteresis_tracker: torch.Tensor | None
    _per_optimizer_states: defaultdict[int, _OptimizerState]
    _step_count: int
    _last_grad_norm: torch.Tensor | None
    _iteration: list[tuple[weakref.ref[torch.optim.Optimizer], StepResult]]
    _last_iteration: list[tuple[weakref.ref[torch.optim.Optimizer], StepResult]]
    _last_skipped: torch.Tensor | None
    _chain_verified: bool
    _optimizers: weakref.WeakSet[torch.optim.Optimizer]
    #: The step plans of each optimizer's parameters, and of clip_grad_norm_'s last call
    #: (see [Note: the step plan]): they hold parameters, so they live with their optimizer.
    _plans: weakref.WeakKeyDictionary[torch.optim.Optimizer, StepPlans]
    _clip_plans: StepPlans
    _optimizers_known: bool
    _loss_scaling: bool
    _policies: tuple[BuiltinPolicy | SkipPolicy, ...]
    _declared: str
    _check_loss: bool
    _spike: SpikeSkip | None
    _spike_window: SpikeWindow | None
    _streak: SkipStreak
    _loss_flag: torch.Tensor | None
    _last_reason: torch.Tensor | None
    _fuse_optimizer: bool
    _fusion: FusionChecks

    @refuse_moved_keywords
    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = DEFAULT_INIT_SCALE,  # 2.0**16, as in torch
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: ProcessGroup | None = None,
        *,
        backend: str | CollectiveBackend | None = None,
        kernels: str | None = None,
        layout: Layout | None = None,
        policies: Iterable[BuiltinPolicy | SkipPolicy] = (),
        loss_scaling: bool | ScaleBounds = True,
        fuse_optimizer: bool = False,
    ) -> None:
        if not isinstance(device, str):
            device = torch.device(device).type  # accept torch.device too
        # The options (see [Note: the scaler's options] in _options), checked before anything.
        bounds = check_loss_scaling_option(loss_scaling)
        self._loss_scaling = bounds is not None
        if bounds is None:
            validate_fixed_scale_options(
                init_scale=init_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
            )
            init_scale = 1.0
            bounds = ScaleBounds()
        if layout is None:
            layout = Layout()
        elif not isinstance(layout, Layout):
            raise TypeError(
                f"layout takes a Layout(distinct_dims=..., distinct_params=...) or None, got "
                f"{type(layout).__name__} {layout!r}"
            )
        split = split_policies(policies)
        self._plugin_policies = check_policies(split.plugins)
        self._plugin_bound: BoundPolicies | None = None
        # A checkpoint's policy states loaded before the policies were bound (by name).
        self._plugin_pending: dict[str, Any] = {}
        self._loss_value: torch.Tensor | None = None
        bad_fuse = _bad_fuse_option(fuse_optimizer, per_call=False)
        if bad_fuse is not None:
            raise bad_fuse
        self._policies = split.given
        self._spike = split.spike
        self._check_loss = split.loss is not None
        self._streak = SkipStreak(split.streak.max_skips if split.streak is not None else None)
        self._declared = declared_options(bounds if self._loss_scaling else None, split)
        self._fuse_optimizer = fuse_optimizer
        self._fusion = FusionChecks()
        self._spike_window = SpikeWindow(self._spike) if self._spike is not None else None
        self._loss_flag: torch.Tensor | None = None
        self._last_reason: torch.Tensor | None = None
        self._device = device
        self._enabled = bool(enabled)
        if device == "cuda" and self._enabled and not torch.cuda.is_available():
            warnings.warn(
                "ShardedGradScaler(device='cuda') is enabled but CUDA is not available; "
                "disabling it (pass device='cpu' to scale on the CPU).",
                stacklevel=3,  # the caller, past refuse_moved_keywords' wrapper
            )
            self._enabled = False
        # Every value is checked against what its float32/int32 tensor can hold
        # (see _scaler_values) before any is stored.
        self._growth_factor = validate_growth_factor(growth_factor)
        self._backoff_factor = validate_backoff_factor(backoff_factor)
        self._growth_interval = validate_growth_interval(growth_interval)
        # ScaleBounds checked its fields; load_state_dict may replace them from a checkpoint.
        self._hysteresis = bounds.hysteresis
        self._min_scale, self._max_scale = bounds.min_scale, bounds.max_scale
        # An explicit init_scale outside the bounds is an error, not a clamp: the user typed it,
        # and silently starting elsewhere would hide a mistake in the scale or the bounds. The
        # untyped default is clamped into the bounds instead.
        self._init_scale = validate_init_scale(
            init_scale, min_scale=self._min_scale, max_scale=self._max_scale
        )
        self._init_growth_tracker = 0
        self._init_hysteresis_tracker = self._hysteresis
        self.process_group = process_group
        self._layout = layout
        self._distinct_dims = frozenset(layout.distinct_dims)
        # The Layout keeps its parameters alive, so that no other tensor can reuse a declared
        # parameter's id(), and so that a copy of the scaler together with its model (pickle,
        # deepcopy) finds the copies.
        self._distinct_params = distinct_param_ids(layout.distinct_params)
        # Every optimizer this scaler stepped: where its declared distinct_params may live;
        # complete once an update() ended an iteration that stepped them.
        self._optimizers = weakref.WeakSet()
        self._optimizers_known = False
        self._plans = weakref.WeakKeyDictionary()
        self._clip_plans = StepPlans(limit=1)
        self._kernels_name = check_kernels(kernels)
        self._backend_spec = backend
        self._backend: CollectiveBackend | None = None
        if backend is not None:
            self._backend = self._reg().make_backend(backend)  # fail early on a bad name
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_tracker: torch.Tensor | None = None
        self._per_optimizer_states = defaultdict(_OptimizerState)
        self._step_count = 0
        self._last_grad_norm: torch.Tensor | None = None
        # Engine results of this iteration and of the last finished one (overflow localisation).
        self._iteration = []
        self._last_iteration = []
        self._chain_verified = False
        self._last_skipped: torch.Tensor | None = None

    # -- plumbing ------------------------------------------------------------------------------

    def _reg(self) -> Registry:
        return get_registry()

    @property
    def backend(self) -> CollectiveBackend:
        """The collective backend found_inf is reduced through (resolved on first use)."""
        if self._backend is None:
            self._backend = self._reg().make_backend(self._backend_spec)
        return self._backend

    def _opt_state(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(
                f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}; pass the "
                "optimizer (scaler.step(optimizer)), not the model or its parameters"
            )
        return self._per_optimizer_states[id(optimizer)]

    @property
    def step_config(self) -> StepConfig:
        """Where this scaler's steps reduce and which plugins they use (see ``run_step``).

        Its backend, process group, registry, kernels and ``distinct_dims``:
        what ``shardscale.clip`` and ``StreamingStats`` pass to the step engine.
        """
        return StepConfig(
            backend=self.backend,
            registry=self._reg(),
            group=self.process_group,
            kernels=self._kernels_name,
            distinct_dims=self._distinct_dims,
            distinct_params=self._distinct_params,
        )

    def _adapter_context(self) -> AdapterContext:
        return self.step_config.adapter_context()

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scale is None or self._growth_tracker is None:
            raise ScalerStateError(
                f"{funcname}() was called before the scale exists: call "
                "scaler.scale(loss).backward() (or scaler.step(optimizer)) earlier in the "
                "iteration."
            )
        return self._scale, self._growth_tracker

    def _ensure_scale(self, optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, torch.Tensor]:
        """The scale, created from ``init_scale`` if this scaler never scaled a loss.

        [Note: a stage that never calls scale()]
        In a pipeline only the last stage computes (and scales) the loss; the
        other stages' gradients arrive already scaled through the pipeline's
        sends. torch's scalers raise there (``_scale is None``). Here the scale
        is created on first need from ``init_scale`` -- the number every rank
        was built with -- so it is identical on every stage from the first
        step, and every later value follows from the same reduced decisions.
        """
        if self._scale is None or self._growth_tracker is None:
            self._lazy_init_scale_growth_tracker(self._scale_device(optimizer))
        assert self._scale is not None and self._growth_tracker is not None
        return self._scale, self._growth_tracker

    def _scale_device(self, optimizer: torch.optim.Optimizer) -> torch.device:
        # Where scale() would have put it: beside the gradients of this scaler's device type.
        for param in optimizer_params(optimizer):
            grad = param.grad
            if grad is not None and grad.device.type == self._device:
                return grad.device
        if self._device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self._device)

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full(
            (), self._init_growth_tracker, dtype=torch.int32, device=dev
        )
        self._hysteresis_tracker = torch.full(
            (), self._init_hysteresis_tracker, dtype=torch.int32, device=dev
        )
        # The verdict's device state lives beside the scale.
        if self._spike_window is not None:
            self._spike_window.materialize(dev)
        self._streak.materialize(dev)
        if self._plugin_policies and self._plugin_bound is None:
            self._plugin_bound = BoundPolicies(self._plugin_policies, dev)
            for policy, state in zip(self._plugin_policies, self._plugin_bound.states, strict=True):
                if policy.name in self._plugin_pending:
                    state.load_state_dict(self._plugin_pending.pop(policy.name))

    # -- scale ---------------------------------------------------------------------------------

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...
    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...
    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...
    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    @eager
    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply a tensor (or nested lists/tuples of tensors) by the scale factor."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            assert self._scale is not None
            if self._check_loss:
                self.observe_loss(outputs)
            elif self._plugin_policies:
                self._observe_loss_value(outputs)
            if not self._loss_scaling:
                return outputs  # the scale is 1: the loss itself, no multiply
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)
        if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Iterable):
            raise TypeError(
                f"scale() takes a tensor or an iterable of tensors, got {type(outputs).__name__}"
            )
        cache: dict[torch.device, torch.Tensor] = {}

        def apply(val: Any) -> Any:
            if isinstance(val, torch.Tensor):
                if self._scale is None:
                    self._lazy_init_scale_growth_tracker(val.device)
                assert self._scale is not None
                if self._check_loss:
                    self.observe_loss(val)
                elif self._plugin_policies:
                    self._observe_loss_value(val)
                if not self._loss_scaling:
                    return val
                if val.device not in cache:
                    cache[val.device] = self._scale.to(device=val.device, non_blocking=True)
                return val * cache[val.device]
            if isinstance(val, (list, tuple)):
                return type(val)(apply(v) for v in val)
            if isinstance(val, Iterable) and not isinstance(val, (str, bytes)):
                return map(apply, val)
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Record whether ``loss`` is finite: a non-finite loss on any rank skips the step everywhere.

        ``scale(loss)`` calls it when the scaler was built with
        ``policies=[LossCheck()]``; call it yourself where the loss is not scaled.
        No host read: the flag rides in the step's one all-reduce (ranks that
        hold no loss, such as the first stages of a pipeline, add nothing).
        Several calls in one iteration (gradient accumulation) combine: any
        non-finite loss skips. Reset by ``update()``.
        """
        if not self._enabled:
            return
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"observe_loss() takes the loss tensor, got {type(loss).__name__}")
        flag = ~torch.isfinite(loss.detach()).all()
        self._loss_flag = (
            flag if self._loss_flag is None else self._loss_flag | flag.to(self._loss_flag.device)
        )
        if self._plugin_policies:
            self._observe_loss_value(loss)

    def _observe_loss_value(self, loss: torch.Tensor) -> None:
        """Add ``loss`` (summed, float64, no host read) to what the skip policies see."""
        value = loss.detach().sum(dtype=torch.float64)
        self._loss_value = (
            value
            if self._loss_value is None
            else self._loss_value + value.to(self._loss_value.device)
        )

    def _verdict(self) -> Verdict:
        reason = SkipReason.OVERFLOW if self._loss_scaling else SkipReason.NONFINITE
        declared = self._declared
        if self._plugin_bound is not None:
            declared += f", policies=[{self._plugin_bound.fingerprint()}]"
        return Verdict(
            nonfinite_reason=reason,
            spike=self._spike_window,
            declared=declared,
            policies=self._plugin_bound,
        )

    # -- unscale -------------------------------------------------------------------------------

    def _run(
        self,
        optimizer: torch.optim.Optimizer,
        apply: Apply,
        *,
        defer_errors: bool = False,
        **options: Any,
    ) -> StepResult:
        """One engine step over ``optimizer``'s gradients with this scaler's scale and config."""
        config = self.step_config
        kernels = options.pop("kernels", None)
        if kernels is not None:
            config = dataclasses.replace(config, kernels=kernels)
        refusal = options.pop("refusal", None)
        if self._distinct_params:
            config, declared = self._own_declarations(optimizer, config)
            refusal = declared or refusal
        self._streak.check()  # a streak an accelerator reported late stops every rank here
        if self._spike is not None and any(ref() is not optimizer for ref, _ in self._iteration):
            # Same on every rank (they step the same optimizers), so raised before the collective.
            raise ValueError(
                "ShardedGradScaler(policies=[SpikeSkip(...)]) tests one global norm per "
                "iteration, but a second optimizer is being stepped before update(); use one "
                "optimizer per scaler (or one scaler per optimizer), or drop the SpikeSkip"
            )
        if not self._chain_verified:
            # Every rank's scaler reaches its first step together: check the chains there.
            config = dataclasses.replace(config, verify_chain=True)
            self._chain_verified = True
        plans = self._plans.get(optimizer)
        if plans is None:
            plans = self._plans[optimizer] = StepPlans()
        result = run_step(
            optimizer_params(optimizer),
            config,
            StepRequest(
                plans=plans,
                apply=apply,
                scale=options.pop("scale", self._scale),
                scale_device_type=self._device,
                defer_errors=defer_errors,
                refusal=refusal,
                verdict=self._verdict(),
                loss_nonfinite=self._loss_flag,
                loss=self._loss_value,
                **options,
            ),
        )
        self._iteration.append((weakref.ref(optimizer), result))
        return result

    def _own_declarations(
        self, optimizer: torch.optim.Optimizer, config: StepConfig
    ) -> tuple[StepConfig, DeclarationError | None]:
        """The declared ``distinct_params`` of ``optimizer``, and a refusal for strangers.

        A scaler may step several optimizers, so a declared parameter outside
        this one is fine if another optimizer of this scaler holds it. One
        that no optimizer of this scaler holds (declared before ``fully_shard``
        replaced the parameters, or of another copy of the model) would be
        ignored silently: refused, through the step, on every rank. Until the
        first ``update()`` the other optimizers may not have been seen yet, so
        only strangers without a gradient (trained by nobody) are refused then.
        """
        self._optimizers.add(optimizer)
        mine = {id(p) for p in optimizer_params(optimizer)}
        strangers = self._distinct_params - mine
        config = dataclasses.replace(config, distinct_params=self._distinct_params & mine)
        if not strangers:
            return config, None
        for other in self._optimizers:
            strangers -= {id(p) for p in optimizer_params(other)}
        unheld = [p for p in self._layout.distinct_params if id(p) in strangers]
        if not self._optimizers_known:
            unheld = [p for p in unheld if p.grad is None]
        if not unheld:
            return config, None
        shapes = ", ".join(str(tuple(p.shape)) for p in unheld[:4])
        return config, DeclarationError(
            f"distinct_params of this ShardedGradScaler holds {len(unheld)} tensor(s) (shapes "
            f"{shapes}{', ...' if len(unheld) > 4 else ''}) that are not parameters of any "
            "optimizer it steps, so they would be ignored. Declare the parameters the "
            "optimizer holds: after fully_shard/.to()/copying the model, pass the new "
            "parameters (e.g. list(model.experts.parameters()) taken after the model is ready)"
        )

    def _check_can_unscale(self, optimizer: torch.optim.Optimizer, what: str) -> _OptimizerState:
        state = self._opt_state(optimizer)
        if state.stage is OptState.UNSCALED:
            raise RuntimeError(
                f"{what} was already called for this optimizer since the last update(): it is "
                "already unscaled in this iteration (by unscale_, unscale_and_clip_ or a fused "
                "step's check); unscale at most once per optimizer per iteration, before "
                "scaler.step(optimizer), then scaler.update()."
            )
        if state.stage is OptState.STEPPED:
            raise RuntimeError(
                f"{what} was called after step() for this optimizer, which is already stepped "
                "in this iteration; unscale once per optimizer before stepping, then call "
                "update() to start the next iteration."
            )
        return state

    def _folds(
        self, optimizer: torch.optim.Optimizer, choice: bool | None = None
    ) -> tuple[bool, Exception | None]:
        """Whether ``optimizer``'s step runs through torch's fused kernel, and why not if asked.

        ``choice`` overrides the scaler's ``fuse_optimizer``. A fused optimizer
        needs nothing: it takes ``grad_scale`` itself. The error (a bad
        ``choice``, or ``fuse_optimizer=True`` when the optimizer does not
        qualify) is returned, not raised: the step's collective carries it to
        every rank.
        """
        bad = _bad_fuse_option(choice)
        if bad is not None:
            return False, bad
        wanted = self._fuse_optimizer if choice is None else choice
        if not wanted or getattr(optimizer, "_step_supports_amp_scaling", False):
            return False, None
        why = self._fusion.refusal(optimizer, self._opt_state(optimizer))
        if why is None:
            return True, None
        if why in PASSING:
            return False, None  # step hooks, or a first step only: the multiply, silently
        return False, ValueError(
            f"fuse_optimizer=True, but this {type(optimizer).__name__}'s step cannot run through "
            f"torch's fused kernel: {why}. Pass fuse_optimizer=False (the default) to step the "
            "optimizer as built, or build it with fused=True where torch has a fused kernel"
        )

    @eager
    def unscale_(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        kernels: str | None = None,
        stats: PrecomputedNorms | None = None,
        fuse_optimizer: bool | None = None,
    ) -> torch.Tensor | None:
        """Divide the optimizer's gradients by the scale and agree on overflow across ranks.

        Optional, as in torch: call it to inspect or clip unscaled gradients
        before :meth:`step`. Raises if called twice for one optimizer between
        updates, or after ``step``.

        With ``max_norm`` (a number > 0, or inf to only measure) it also clips
        the global ``norm_type``-norm in the same read and the same collective,
        and returns that norm (see ``shardscale.clip.unscale_and_clip_``, the
        validating front end); a fused optimizer's gradients are then left
        scaled and :meth:`step` hands it ``grad_scale = scale / clip_coef``.
        So are those of an unfused torch SGD/Adam/AdamW whose step the scaler
        runs through torch's fused kernel (``fuse_optimizer``: this call's
        choice, ``None`` the scaler's, which is False by default; see the class). Without ``max_norm``
        the gradients are always left unscaled.
        ``kernels`` overrides the scaler's stats kernels; ``stats`` supplies
        per-gradient norms read during backward (``StreamingStats``).
        """
        if not self._enabled:
            # Nothing is read: the options are still checked, as an enabled scaler's step does.
            if max_norm is not None:
                check_max_norm(max_norm)
                check_norm_type(norm_type)
            check_kernels(kernels)
            return None
        check_kernels(kernels)
        what = "unscale_()" if max_norm is None else "unscale_and_clip_()"
        state = self._check_can_unscale(optimizer, what)
        self._ensure_scale(optimizer)
        # A refusal of fuse_optimizer=True reaches every rank through this step's collective.
        fold, refusal = self._folds(optimizer, fuse_optimizer)
        if max_norm is None and self._spike is not None:
            # The spike test needs the global norm: read in the same pass, in the same collective
            # (a multiply by 1/scale after the read; nothing to write when the scale is 1).
            result = self._run(
                optimizer,
                Apply.MULTIPLY if self._loss_scaling else Apply.NOTHING,
                norm_type=2.0,
                kernels=kernels,
                refusal=refusal,
            )
            state.record(result, grad_scale=None)
            self._last_grad_norm = result.norm
            return None
        if max_norm is None:
            # Lazy: the flag is awaited at step(), so a coalescing middleware can merge several
            # optimizers' reductions; a peer's error surfaces there too, the grads being
            # unscaled and recorded as such by then. With the scale fixed at 1 there is nothing
            # to unscale: a read-only check.
            result = self._run(
                optimizer,
                Apply.UNSCALE if self._loss_scaling else Apply.NOTHING,
                kernels=kernels,
                defer_errors=True,
                lazy=True,
                refusal=refusal,
            )
            if result.local_error is not None:
                result.wait()
                result.raise_errors()
            state.record(result, grad_scale=None)
            return None
        fused = fold or bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        result = self._run(
            optimizer,
            Apply.FUSED if fused else Apply.MULTIPLY,
            norm_type=norm_type,
            max_norm=max_norm,
            kernels=kernels,
            precomputed=stats,
            refusal=refusal,
        )
        state.record(result, grad_scale=result.grad_scale)
        state.folded = fold
        self._last_grad_norm = result.norm
        return result.norm

    @eager
    def clip_grad_norm_(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        *,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """Clip the gradients of ``parameters`` by their true global norm, with this scaler's configuration.

        For gradients that are already unscaled (after :meth:`unscale_`, or
        with a disabled scaler): the global ``norm_type``-norm of every
        parameter's gradient over this scaler's process group, backend,
        kernels, ``distinct_dims`` and those of ``parameters`` this scaler
        declared in ``distinct_params`` -- in one read and ONE collective --
        then every local gradient multiplied once by
        ``min(1, max_norm / (norm + 1e-6))``. What framework integrations call
        when asked to clip a subset of parameters, or parameters of several
        optimizers; for one optimizer's still-scaled gradients,
        ``unscale_(optimizer, max_norm=...)`` does the unscale in the same pass.

        Args:
            parameters: a tensor or an iterable of tensors whose ``.grad`` is clipped.
            max_norm: a number > 0; ``float('inf')`` only measures.
            norm_type: any p > 0, or ``float('inf')``.
            error_if_nonfinite: raise on every rank, before any gradient
                changes, when the norm is inf or nan (costs a host sync).
            foreach: None: this scaler's kernels; True/False: the ``foreach``/``loop`` kernels.

        Returns:
            The global norm, a 0-dim tensor identical on every rank, in torch's
            dtype (the promotion of the gradients' dtypes; computed in float32 or
            float64). Options are checked by ``shardscale.core``'s contract
            before anything changes.
        """
        items = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        config = self.step_config
        ids = {id(p) for p in items}
        config = dataclasses.replace(
            config,
            kernels=kernels_name(foreach, config.kernels),
            # Declared parameters outside this call are another call's business.
            distinct_params=frozenset(i for i in config.distinct_params if i in ids),
        )
        norm = clip_parameters_(
            items,
            config,
            max_norm=max_norm,
            norm_type=norm_type,
            error_if_nonfinite=error_if_nonfinite,
            plans=self._clip_plans,
        )
        self._last_grad_norm = norm
        return norm

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        """torch's private helper, kept for code that calls it: unscale by ``inv_scale``.

        As torch's: it needs no scale of its own (torch's tests call it on a
        scaler that never scaled a loss), leaves ``found_inf`` as it was and
        returns a copy of it per device, set where a gradient overflowed.
        Unlike torch's, that flag is already reduced over the scaler's process
        group, so code that all-reduces it again still sees "nonzero iff any
        rank overflowed".
        """
        if not allow_fp16:
            for param in optimizer_params(optimizer):
                if param.grad is not None and param.grad.dtype is torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
        # The engine places its result beside the scale; without one, beside inv_scale.
        scale = self._scale if self._scale is not None else inv_scale.reshape(-1)[0].reciprocal()
        result = self._run(optimizer, Apply.UNSCALE, unscale_by=inv_scale, scale=scale)
        flag = torch.maximum(found_inf, result.found_inf.to(found_inf.device))
        return {flag.device: flag}

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, Any]:
        """torch's private helper: check (without unscaling) and record the reduced flags."""
        state = self._opt_state(optimizer)
        self._ensure_scale(optimizer)
        result = self._run(optimizer, Apply.NOTHING)
        state.record_verdict(result)
        found: dict[torch.device, Any] = state["found_inf_per_device"]
        return found

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, Any]:
        """torch's private helper: the recorded per-device flags of ``optimizer``."""
        found: dict[torch.device, Any] = self._opt_state(optimizer)["found_inf_per_device"]
        return found

    # -- step ----------------------------------------------------------------------------------

    @eager
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (if not done yet) and call ``optimizer.step()`` unless any rank overflowed.

        Returns what ``optimizer.step`` returns, or ``None`` when the step is skipped.
        Closures are not supported (as in torch).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError(
                "step() got a closure, which gradient scaling does not support: compute the "
                "loss, call scaler.scale(loss).backward(), then scaler.step(optimizer)."
            )
        state = self._opt_state(optimizer)
        scale, _ = self._ensure_scale(optimizer)
        if state.stage is OptState.STEPPED:
            raise RuntimeError(
                "step() was already called for this optimizer since the last update(); call "
                "scaler.update() once per iteration after stepping every optimizer."
            )
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, state, scale, args, kwargs)
        if state.folded and step_hooks(optimizer):
            # Hooks registered since unscale_and_clip_ left the gradients scaled: they see them
            # unscaled, on a step taken only, as in torch's recipe.
            unfold_gradients_(optimizer, state.grad_scale)
            state.folded, state.grad_scale = False, None
        # Left scaled for torch's fused kernel by unscale_and_clip_; or, only when asked for
        # (fuse_optimizer=True), not yet read or unscaled by an explicit unscale_ (the kernel
        # then gets grad_scale None).
        if state.folded or (self._fuse_optimizer and self._folds(optimizer)[0]):
            return self._fused_step(optimizer, state, scale, args, kwargs, fold=True)
        if state.stage is OptState.READY:
            self.unscale_(optimizer)
        found_inf = state.found_inf(scale.device)
        if found_inf is None:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        retval = None
        # The one host sync of an unfused step: the optimizer runs on the host's say-so.
        if not found_inf.item():
            retval = optimizer.step(*args, **kwargs)
        else:
            self._note_nonfinite_tensors(optimizer)
        poll_errors()  # the sync above made any pending accelerator error block readable
        state.stage = OptState.STEPPED
        return retval

    def _note_nonfinite_tensors(self, optimizer: torch.optim.Optimizer) -> None:
        # A skipped unfused step is known on the host anyway: keep which tensors were bad while
        # they are alive (torch's unscale kernel only gives one flag), for overflow_report().
        for opt_ref, result in self._iteration:
            if opt_ref() is optimizer and result.finite is None:
                result.finite = torch.tensor(
                    [t is None or bool(torch.isfinite(t).all()) for _, t in result.owners],
                    dtype=torch.bool,
                )

    def _fused_step(
        self,
        optimizer: torch.optim.Optimizer,
        state: _OptimizerState,
        scale: torch.Tensor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        fold: bool = False,
    ) -> Any:
        # Fused optimizers unscale and skip on device: no host sync, no separate unscale pass.
        # ``fold``: an unfused torch optimizer run through torch's fused kernel for this step.
        if not fold and "grad_scaler" in inspect.signature(optimizer.step).parameters:
            # torch's older contract (apex-style optimizers): pass the scaler itself; the
            # optimizer calls _check_inf_per_device / _get_scale_async as it needs.
            warnings.warn(
                "this optimizer's step() takes grad_scaler=, a contract torch is retiring: "
                "ShardedGradScaler passes itself as torch.amp.GradScaler does, but prefer an "
                "optimizer that reads optimizer.grad_scale and optimizer.found_inf.",
                FutureWarning,
                stacklevel=3,
            )
            retval = optimizer.step(*args, **{**kwargs, "grad_scaler": self})
            state.stage = OptState.STEPPED
            return retval
        if state.stage is OptState.READY:
            if self._spike is not None:
                # The spike test needs the global norm: read in the same check (not lazy).
                result = self._run(optimizer, Apply.NOTHING, norm_type=2.0)
                self._last_grad_norm = result.norm
            else:
                result = self._run(optimizer, Apply.NOTHING, defer_errors=True, lazy=True)
                if result.local_error is not None:  # this rank's own error: before any record
                    result.wait()
                    result.raise_errors()
            if fold:
                # With the scale fixed at 1 there is nothing to divide by.
                state.record(result, grad_scale=scale if self._loss_scaling else None)
                state.folded = True
            else:
                state.record(result, grad_scale=scale * getattr(optimizer, "grad_scale", 1))
        elif state.grad_scale is None and not fold:
            state.grad_scale = getattr(optimizer, "grad_scale", None)
        found_inf = state.found_inf(scale.device)
        if found_inf is None:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        local = self._fusion.local(optimizer, state)
        if fold or local:
            # Folded, or natively fused over DTensors: torch's kernel (on the local shards).
            retval = fused_kernel_step(
                optimizer, state.grad_scale, found_inf, *args, local=local, **kwargs
            )
            state.stage = OptState.STEPPED
            return retval
        optimizer.grad_scale = state.grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        state.stage = OptState.STEPPED
        return retval

    # -- update --------------------------------------------------------------------------------

    @eager
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back the scale off if any optimizer overflowed, grow it after ``growth_interval`` clean steps.

        ``new_scale`` sets the scale directly instead (a Python float, or a
        one-element tensor on the scaler's device type). Either way it
        publishes the iteration's verdict (:attr:`last_step_skipped`,
        :attr:`last_skip_reason`), feeds an accepted norm to the spike window
        and counts the streak of skipped steps, raising
        :class:`~shardscale.core.SkipStreakError` at a :class:`~shardscale.core.SkipStreakLimit`.
        Only a non-finite gradient backs the scale off (docs/skipped-steps.md).
        """
        if not self._enabled:
            return
        self._streak.check()
        scale, tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None and not self._loss_scaling:
            raise ScalerStateError(
                "update(new_scale=...) on a ShardedGradScaler(loss_scaling=False): the scale is "
                "fixed at 1; call update() without new_scale"
            )
        verdict = self._iteration_verdict(scale.device)
        if new_scale is not None:
            self._set_scale(scale, new_scale)
        elif verdict is None:
            raise ScalerStateError(
                "update() found no overflow checks this iteration: call scaler.step(optimizer) "
                "(or unscale_) for at least one optimizer before update()."
            )
        if verdict is None:  # update(new_scale=...) with nothing stepped: nothing skipped
            zero = torch.zeros((), dtype=torch.int64, device=scale.device)
            verdict = (zero.float(), zero.float(), zero)
        skip, found, reason = verdict
        if new_scale is None and self._loss_scaling:
            # Only a non-finite gradient backs off; a spike or loss skip is a clean step here.
            self._update_scale(scale, tracker, found)
        self._last_skipped = skip > 0
        self._last_reason = reason
        # The window keeps accepted norms only: the last one this iteration's step tested.
        if self._spike_window is not None and any(r.norm is not None for _, r in self._iteration):
            # Its rows are SkipReason's: a third-party code (16..62) is a skip like any other.
            kept = reason if self._plugin_bound is None else reason.clamp(max=int(SkipReason.ERROR))
            self._spike_window.accept(kept)
        if self._plugin_bound is not None and self._iteration:
            for policy_state in self._plugin_bound.states:
                policy_state.after_update(reason)
        poll_errors()  # an accelerator step's error that already arrived surfaces here, no sync
        self._optimizers_known = bool(self._optimizers)
        self._per_optimizer_states = defaultdict(_OptimizerState)
        for _, result in self._iteration:
            result.owners.release()  # a kept iteration holds no gradient memory
        self._last_iteration, self._iteration = self._iteration, []
        self._loss_flag = self._loss_value = None
        self._step_count += 1
        if new_scale is None and self._reg().has_step_observers():
            assert self._growth_tracker is not None
            hyst = self._hysteresis_tracker
            record = StepRecord(
                step=self._step_count,
                scale=self._scale.clone() if self._scale is not None else scale,
                found_inf=found,
                skipped=self._last_skipped,
                growth_tracker=self._growth_tracker.clone(),
                grad_norm=self._last_grad_norm,
                hysteresis_tracker=hyst.clone() if hyst is not None else None,
                nonfinite_per_rank=_nonfinite_per_rank(self._last_iteration),
                skip_reason=reason,
            )
            self._reg().notify_step(record)
        self._last_grad_norm = None
        # Last: a streak that reached the limit raises with the scaler's state complete.
        self._streak.after_update(self._last_skipped, reason, step=self._step_count)

    def _iteration_verdict(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """This iteration's skip flag, overflow flag (float32) and SkipReason over every optimizer.

        None when no optimizer was checked. Each optimizer obeys its own
        verdict; the iteration is skipped if any was, for the strongest reason.
        """
        skips, overflows, reasons = [], [], []
        for state in self._per_optimizer_states.values():
            skip = state.found_inf(device)  # settles a lazy step first
            if skip is None:
                continue
            skips.append(skip)
            overflow = state.overflow if state.overflow is not None else skip
            overflows.append(_on(overflow, device))
            if state.reason is not None:
                reasons.append(_on(state.reason, device))
        if not skips:
            return None
        if not reasons:  # flags written by code outside the engine: a non-finite gradient, if any
            kind = self._verdict().nonfinite_reason
            reasons = [torch.where(flag > 0, int(kind), 0) for flag in skips]
        # The common case, one optimizer, costs no device op here.
        bound = self._plugin_bound
        if bound is not None and len(reasons) > 1:
            # A third-party code (16..62) is no precedence: compare the reasons' ranks.
            return _strongest(skips), _strongest(overflows), bound.strongest(reasons)
        return _strongest(skips), _strongest(overflows), _strongest(reasons)

    def _set_scale(self, scale: torch.Tensor, new_scale: float | torch.Tensor) -> None:
        if isinstance(new_scale, torch.Tensor):
            problem = None
            if new_scale.device.type != self._device:
                problem = f"it is on {new_scale.device.type}, the scaler on {self._device}"
            elif new_scale.numel() != 1:
                problem = f"it has {new_scale.numel()} elements"
            elif new_scale.requires_grad:
                problem = "it requires grad"
            elif not new_scale.is_floating_point():
                problem = f"its dtype is {new_scale.dtype}"
            elif not bool(torch.isfinite(new_scale).all()) or float(new_scale.reshape(())) <= 0:
                problem = (
                    f"its value {float(new_scale.reshape(()))} is not a finite positive number"
                )
            if problem:
                raise ScalerStateError(
                    f"update(new_scale=...) needs a float or a one-element float tensor on "
                    f"{self._device} without grad; {problem}."
                )
            value = float(new_scale.reshape(()))
            self._check_new_scale(value, f"update(new_scale=tensor({value!r}))")
            scale.copy_(new_scale.reshape(()))
            return
        if not isinstance(new_scale, float):
            raise TypeError(
                f"update(new_scale=...) takes a float or a one-element tensor, got "
                f"{type(new_scale).__name__} {new_scale!r}; write e.g. update(new_scale=1024.0)"
            )
        if not math.isfinite(new_scale) or new_scale <= 0:
            raise ScalerStateError(
                f"update(new_scale={new_scale!r}): the scale must be a finite number > 0"
            )
        self._check_new_scale(new_scale, f"update(new_scale={new_scale!r})")
        scale.fill_(new_scale)

    def _check_new_scale(self, value: float, shown: str) -> None:
        # Fits float32 and, like every scale, stays within the bounds (an error: it is explicit).
        validate_scale(
            value,
            name="new_scale",
            shown=shown,
            min_scale=self._min_scale,
            max_scale=self._max_scale,
            bounds_fix="; pass a new_scale within [min_scale, max_scale]",
        )

    def _update_scale(
        self, scale: torch.Tensor, tracker: torch.Tensor, found: torch.Tensor
    ) -> None:
        if self._hysteresis == 1 and self._min_scale is None and self._max_scale is None:
            torch._amp_update_scale_(
                scale,
                tracker,
                found,
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
            )
            # torch's kernel backs off without a floor; a zero or subnormal scale has an inf
            # reciprocal and never recovers. A no-op above the floor: still torch's numbers.
            scale.clamp_(min=FLOAT32_TINY)
            return
        assert self._hysteresis_tracker is not None
        hyst = self._hysteresis_tracker
        overflow = found > 0
        back_off = overflow & (hyst <= 1)
        hyst.copy_(
            torch.where(overflow, (hyst - 1).clamp(min=1), torch.full_like(hyst, self._hysteresis))
        )
        # tracker < growth_interval <= int32 max, so tracker + 1 cannot wrap.
        counted = torch.where(overflow, torch.zeros_like(tracker), tracker + 1)
        complete = (~overflow) & (counted >= self._growth_interval)
        grown = scale * self._growth_factor
        grow = complete & torch.isfinite(grown)
        # Reset when the interval completes, grown or not (as torch's kernel does), so the
        # tracker never climbs past the interval while growth is refused.
        tracker.copy_(torch.where(complete | overflow, torch.zeros_like(tracker), counted))
        new = torch.where(back_off, scale * self._backoff_factor, torch.where(grow, grown, scale))
        scale.copy_(new.clamp(min=scale_floor(self._min_scale), max=self._max_scale))

    # -- getters and setters -------------------------------------------------------------------

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Syncs with the device."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_factor(self) -> float:
        """The factor the scale grows by after ``growth_interval`` clean steps."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (must be > 1 and finite in float32)."""
        self._growth_factor = validate_growth_factor(new_factor)

    def get_backoff_factor(self) -> float:
        """The factor the scale shrinks by after an overflow."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (must be in (0, 1), and not below float32's smallest normal)."""
        self._backoff_factor = validate_backoff_factor(new_factor)

    def get_growth_interval(self) -> int:
        """How many consecutive clean steps make the scale grow."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an int in [1, 2**31 - 1]).

        A tracker already at or past a shrunk interval is kept at ``interval - 1``:
        the interval is complete and the next clean step grows the scale. (torch's
        kernel waits for ``tracker + 1 == interval`` and would never grow again.)
        """
        interval = validate_growth_interval(new_interval)
        self._growth_interval = interval
        self._init_growth_tracker = min(self._init_growth_tracker, interval - 1)
        if self._growth_tracker is not None:
            self._growth_tracker.clamp_(max=interval - 1)

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        if self._growth_tracker is None:
            return self._init_growth_tracker
        return int(self._growth_tracker.item())

    def _get_hysteresis_tracker(self) -> int:
        if self._hysteresis_tracker is None:
            return self._init_hysteresis_tracker
        return int(self._hysteresis_tracker.item())

    @property
    def scale_tensor(self) -> torch.Tensor | None:
        """The live scale: a 0-dim float32 tensor on the scale's device, read without a host sync.

        What :meth:`get_scale` returns as a float, for loggers that keep values on
        the device (Lightning's ``self.log``). ``None`` before the first
        :meth:`scale` and when disabled. Treat it as read-only.
        """
        return self._scale if self._enabled else None

    @property
    def last_step_skipped(self) -> torch.Tensor | None:
        """Whether the last ``update()`` saw an overflow: a 0-dim bool tensor on the scale's device.

        Reading it costs nothing until you turn it into a Python bool. Use it to
        keep a learning-rate schedule from advancing on skipped steps without a
        host sync (docs/guarantees.md, "skip signal"). ``None`` before the first
        ``update()`` and when disabled.
        """
        return self._last_skipped

    @property
    def last_skip_reason(self) -> torch.Tensor | None:
        """Why the last ``update()``'s step was skipped: a 0-dim int64 tensor on the scale's device.

        It holds a :class:`~shardscale.core.SkipReason` value (0, ``NONE``:
        taken), identical on every rank; ``SkipReason(int(t))`` names it (a
        host read). ``None`` before the first ``update()`` and when disabled.
        """
        return self._last_reason

    @property
    def loss_scaling(self) -> bool:
        """Whether the loss is scaled (``False``: the scale is fixed at 1)."""
        return self._loss_scaling

    @property
    def policies(self) -> tuple[BuiltinPolicy | SkipPolicy, ...]:
        """The skip policies this scaler was built with, as given (``()``: none)."""
        return self._policies

    @property
    def layout(self) -> Layout:
        """What this rank declared about where its parameters live (``Layout()``: nothing)."""
        return self._layout

    @property
    def scale_bounds(self) -> ScaleBounds:
        """The hysteresis and bounds in force (a checkpoint's, after ``load_state_dict``)."""
        return ScaleBounds(
            hysteresis=self._hysteresis, min_scale=self._min_scale, max_scale=self._max_scale
        )

    @eager
    def overflow_report(self, module: torch.nn.Module | None = None) -> OverflowReport:
        """Which ranks and which parameters held non-finite gradients in the last iteration.

        Call it on **every** rank of the scaler's process group, after
        ``update()`` (the gradients may be freed by then: a skipped ``step()``
        noted which were non-finite); it
        gathers each rank's findings in one extra collective, so call it only
        when you want to know (e.g. when ``last_step_skipped`` is true). Clean
        steps pay nothing for this. ``module`` gives parameters their fully
        qualified names; without it they are named by optimizer position. The
        report's ``reason`` is :attr:`last_skip_reason`, so a step skipped for a
        spike or its loss (no non-finite gradient) says so.
        """
        return build_overflow_report(
            self._last_iteration,
            module=module,
            step=self._step_count,
            group=self.process_group if self._enabled else None,
            reason=self.last_skip_reason,
        )

    def is_enabled(self) -> bool:
        """Whether scaling is on."""
        return self._enabled

    def get_hysteresis(self) -> int:
        """Consecutive overflow steps needed before the scale backs off."""
        return self._hysteresis

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state as plain Python numbers, with torch's keys.

        Loadable by :class:`torch.amp.GradScaler` (extra keys appear only when
        hysteresis or bounds are set, and torch ignores them) and with
        ``torch.load(..., weights_only=True)``. Empty when disabled, as in torch.
        """
        if not self._enabled:
            return {}
        state: dict[str, Any] = {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }
        # The bounds' own keys (only those off torch's rules), and the tracker hysteresis counts.
        state.update(self.scale_bounds.state())
        if self._hysteresis != 1:
            state["_hysteresis_tracker"] = self._get_hysteresis_tracker()
        # The verdict's state, only where its options are on (torch ignores extra keys).
        if not self._loss_scaling:
            state["loss_scaling"] = False
        if self._spike_window is not None:
            state["spike_window"], state["spike_accepted"] = self._spike_window.state()
        if self._streak.limit is not None:
            state["_skip_streak"], state["_skip_streak_reasons"] = self._streak.state()
            # The update count, so that a streak error after a resume names real step numbers.
            state["_steps"] = self._step_count
        for at, policy in enumerate(self._plugin_policies):
            if self._plugin_bound is not None:
                state[f"policy.{policy.name}"] = self._plugin_bound.states[at].state_dict()
            elif policy.name in self._plugin_pending:
                state[f"policy.{policy.name}"] = self._plugin_pending[policy.name]
        return state

    @eager
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state written by this class or by torch's GradScaler/ShardedGradScaler.

        Every key is validated before anything changes: a malformed dict raises
        an error naming the bad key and leaves the scaler as it was.
        """
        if not self._enabled:
            return
        values = validate_state_dict(
            state_dict,
            hysteresis=self._hysteresis,
            min_scale=self._min_scale,
            max_scale=self._max_scale,
        )
        spike_state, streak = self._validate_verdict_state(state_dict, values.scale)
        # A policy validates its own state: loaded first, so a bad one changes nothing else.
        for at, policy in enumerate(self._plugin_policies):
            saved = state_dict.get(f"policy.{policy.name}")
            if saved is None:
                continue
            if self._plugin_bound is not None:
                self._plugin_bound.states[at].load_state_dict(saved)
            else:
                # Not bound yet (no step so far): checked now on a throwaway CPU state.
                policy.bind(torch.device("cpu")).load_state_dict(saved)
                self._plugin_pending[policy.name] = saved
        # Validated: now apply, all at once (every value fits its float32/int32 tensor).
        self._init_scale = values.scale
        self._growth_factor = values.growth_factor
        self._backoff_factor = values.backoff_factor
        self._growth_interval = values.growth_interval
        self._init_growth_tracker = values.growth_tracker
        self._hysteresis = values.hysteresis
        self._init_hysteresis_tracker = values.hysteresis_tracker
        self._min_scale = values.min_scale
        self._max_scale = values.max_scale
        if self._loss_scaling:  # the bounds are declared: every rank must load the same ones
            self._declared = declared_options(self.scale_bounds, split_policies(self._policies))
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(self._init_growth_tracker)
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)
        if self._spike_window is not None and spike_state is not None:
            self._spike_window.load(*spike_state)
        if streak is not None:
            self._streak.load(*streak)
        if "_steps" in state_dict:
            self._step_count = int(state_dict["_steps"])

    def _validate_verdict_state(
        self, state_dict: dict[str, Any], scale: float
    ) -> tuple[tuple[list[float], int] | None, tuple[int, int] | None]:
        """The checkpoint's spike window and streak, checked against this scaler's options.

        A window saved with a :class:`SpikeSkip` is ignored by a scaler without
        one; a scaler with one loading a checkpoint without a window starts an
        empty one (a run that turns the test on).
        """
        saved = state_dict.get("loss_scaling", True)
        if saved is not self._loss_scaling:
            raise ScalerStateError(
                f"this checkpoint was saved by a scaler with loss_scaling={saved!r}, and this one "
                f"has loss_scaling={self._loss_scaling!r}; build the scaler with "
                f"loss_scaling={saved!r}, or start the new precision from a fresh scaler "
                "(a bf16 run has no scale to restore)"
            )
        if not self._loss_scaling and scale != 1.0:
            raise ScalerStateError(
                f"state dict key 'scale' is {scale!r}, but loss_scaling=False fixes it at 1.0"
            )
        try:
            spike_state = validate_spike_state(state_dict)
        except ValueError as exc:
            raise ScalerStateError(str(exc)) from None
        streak = None
        if "_skip_streak" in state_dict:
            count, mask = state_dict["_skip_streak"], state_dict.get("_skip_streak_reasons", 0)
            if not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (count, mask)
            ):
                raise ScalerStateError(
                    f"state dict keys '_skip_streak'/'_skip_streak_reasons' must be ints >= 0, "
                    f"got {count!r}/{mask!r}; save the state with scaler.state_dict()"
                )
            streak = (count, mask)
        steps = state_dict.get("_steps", 0)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(
                f"scaler state dict key '_steps' must be an int >= 0 (the number of update() "
                f"calls), got {steps!r}; save the state with scaler.state_dict()"
            )
        return spike_state, streak

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if self._per_optimizer_states:
                # ScalerStateError is also an AssertionError: what torch raises here.
                raise ScalerStateError(
                    "a ShardedGradScaler can only be pickled at the start of an iteration or "
                    "after update(); call scaler.update() first, or save scaler.state_dict()"
                )
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_hysteresis_tracker"] = self._get_hysteresis_tracker()
            state["_scale"] = state["_growth_tracker"] = state["_hysteresis_tracker"] = None
        state["_iteration"], state["_last_iteration"] = [], []
        state["_last_skipped"] = state["_last_grad_norm"] = None
        state["_last_reason"] = state["_loss_flag"] = state["_loss_value"] = None
        # Third-party policies' device state travels as their state_dict, bound again on use.
        if self._plugin_bound is not None:
            state["_plugin_pending"] = {
                p.name: st.state_dict()
                for p, st in zip(self._plugin_policies, self._plugin_bound.states, strict=True)
            }
            state["_plugin_bound"] = None
        # The verdict's device state travels as host values, like the scale.
        if self._spike_window is not None:
            window = SpikeWindow(self._spike_window.policy)
            window.load(*self._spike_window.state())
            state["_spike_window"] = window
        streak = SkipStreak(self._streak.limit)
        streak.load(*self._streak.state())
        state["_streak"] = streak
        state["_per_optimizer_states"] = defaultdict(_OptimizerState)
        state["_backend"] = None  # rebuilt from the spec on first use
        if not isinstance(state["_backend_spec"], (str, type(None))):
            state["_backend_spec"] = None
        state["_optimizers"] = None  # weak references do not copy; found again on first step
        state["_plans"] = state["_clip_plans"] = None  # a copy starts cold
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A scaler pickled before the verdict's options existed: torch's behaviour.
        for name, value in (("_loss_scaling", True), ("_check_loss", False), ("_spike", None)):
            state.setdefault(name, value)
        state.setdefault("_spike_window", None)
        state.setdefault("_streak", SkipStreak(None))
        state.setdefault("_loss_flag", None)
        state.setdefault("_last_reason", None)
        state.pop("_registry", None)  # pickled before the scaler used the process registry
        if "_layout" not in state:  # pickled before the options were objects
            state["_layout"] = Layout(
                distinct_dims=tuple(state.get("_distinct_dims", ())),
                distinct_params=state.pop("_distinct_refs", ()),
            )
        if "_policies" not in state:
            spike, limit = state["_spike"], state["_streak"].limit
            state["_policies"] = tuple(
                p
                for p in (
                    spike,
                    LossCheck() if state["_check_loss"] else None,
                    SkipStreakLimit(limit) if limit is not None else None,
                )
                if p is not None
            )
        state.setdefault("_plugin_policies", ())
        state.setdefault("_plugin_bound", None)
        state.setdefault("_plugin_pending", {})
        state.setdefault("_loss_value", None)
        state.setdefault("_fusion", FusionChecks())
        if state.get("_fuse_optimizer") is None:
            state["_fuse_optimizer"] = False  # pickled when None (fold after clipping) existed
        self.__dict__.update(state)
        if "_declared" not in state:
            self._declared = declared_options(
                self.scale_bounds if self._loss_scaling else None, split_policies(self._policies)
            )
        # id()s do not survive a copy: take them again from the (copied) declared parameters.
        self._distinct_params = frozenset(id(p) for p in self._layout.distinct_params)
        self._optimizers, self._optimizers_known = weakref.WeakSet(), False
        self._plans, self._clip_plans = weakref.WeakKeyDictionary(), StepPlans(limit=1)
