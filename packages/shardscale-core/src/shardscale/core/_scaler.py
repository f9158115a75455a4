"""ShardedGradScaler: dynamic loss scaling whose skip/step decision is identical on every rank.

[Note: parity with torch.amp.GradScaler]
With default options the arithmetic is torch's own: gradients are unscaled by
``torch._amp_foreach_non_finite_check_and_unscale_`` with the same
``inv_scale`` (the float64 reciprocal of the scale, rounded to float32), and
the scale moves through ``torch._amp_update_scale_``. The per-optimizer state
machine (READY → UNSCALED → STEPPED, reset by ``update``) and the errors for
misuse follow torch's. What differs is only *where* found_inf comes from:
every device's flag is summed on the scale's device and reduced in ONE
collective over the scaler's process group, on every path into ``step`` —
including fused optimizers that skip ``unscale_`` — so every rank decides the
same way whatever layout its parameters have.

[Note: options beyond torch]
``hysteresis``, ``min_scale`` and ``max_scale`` are off by default. When any
is set, the update runs as tensor arithmetic on the scale's device (no host
sync) instead of torch's fused update kernel.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Iterable
from enum import Enum
from typing import TYPE_CHECKING, Any, overload

import torch

from shardscale.core._errors import ShardscaleError
from shardscale.core._gradients import collect_grads, optimizer_params
from shardscale.core._protocols import (
    AdapterContext,
    CollectiveBackend,
    Handle,
    ReduceOp,
    StepRecord,
)
from shardscale.core._registry import Registry, get_registry
from shardscale.core._scaler_values import (
    DEFAULT_INIT_SCALE,
    FLOAT32_TINY,
    ScalerStateError,
    scale_floor,
    validate_backoff_factor,
    validate_bounds,
    validate_growth_factor,
    validate_growth_interval,
    validate_hysteresis,
    validate_init_scale,
    validate_scale,
    validate_state_dict,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# ScalerStateError is defined in _scaler_values and re-exported here.
__all__ = ["OptState", "ShardedGradScaler", "ScalerStateError"]


class OptState(Enum):
    """Where an optimizer is in the current iteration."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


class _OptimizerState:
    __slots__ = ("found_inf", "grad_scale", "handle", "stage")

    def __init__(self) -> None:
        self.stage = OptState.READY
        self.found_inf: torch.Tensor | None = None
        self.handle: Handle | None = None
        # Set by unscale_and_clip_ for fused optimizers: the factor the optimizer divides by.
        self.grad_scale: torch.Tensor | None = None

    def reduced_found_inf(self) -> torch.Tensor:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            try:
                handle.wait()
            except Exception as exc:
                _note_found_inf(exc)
                raise
            assert self.found_inf is not None
            # A SUM over ranks (and devices) may exceed 1, but fused optimizers skip their step
            # only when found_inf == 1 exactly: with 2 overflowing ranks they would apply nan.
            self.found_inf.clamp_(max=1.0)
        assert self.found_inf is not None
        return self.found_inf


def _note_found_inf(exc: BaseException) -> None:
    # A note, not a new exception: the backend's error type (and message) stays catchable.
    exc.add_note(
        "shardscale: this was ShardedGradScaler's found_inf all-reduce, which every rank of "
        "the scaler's process group joins once per step(); a rank that died, raised or "
        "skipped step()/unscale_() leaves the others failing here"
    )


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
        hysteresis: back off only after this many consecutive overflow steps
            (Megatron-LM / DeepSpeed style). 1 (default) is torch's behaviour.
        min_scale, max_scale: bounds the scale never leaves (default: none).
        distinct_dims: mesh dimension names whose coordinates hold different
            parameters (pipeline stages); ``"*"`` marks plain tensors as distinct
            on every rank. Used by clipping to avoid double counting.
        registry: the plugin registry (default: the process-wide one).
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
    _distinct_dims: frozenset[str]
    _registry: Registry | None
    _kernels_name: str | None
    _backend_spec: str | CollectiveBackend | None
    _backend: CollectiveBackend | None
    _scale: torch.Tensor | None
    _growth_tracker: torch.Tensor | None
    _hysteresis_tracker: torch.Tensor | None
    _per_optimizer_states: dict[int, _OptimizerState]
    _step_count: int
    _last_grad_norm: torch.Tensor | None

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
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        distinct_dims: Iterable[str] = (),
        registry: Registry | None = None,
    ) -> None:
        if not isinstance(device, str):
            device = torch.device(device).type  # accept torch.device too
        self._device = device
        self._enabled = bool(enabled)
        if device == "cuda" and self._enabled and not torch.cuda.is_available():
            warnings.warn(
                "ShardedGradScaler(device='cuda') is enabled but CUDA is not available; "
                "disabling it (pass device='cpu' to scale on the CPU).",
                stacklevel=2,
            )
            self._enabled = False
        # Every value is checked against what its float32/int32 tensor can hold
        # (see _scaler_values) before any is stored.
        self._growth_factor = validate_growth_factor(growth_factor)
        self._backoff_factor = validate_backoff_factor(backoff_factor)
        self._growth_interval = validate_growth_interval(growth_interval)
        self._hysteresis = validate_hysteresis(hysteresis)
        self._min_scale, self._max_scale = validate_bounds(min_scale, max_scale)
        # An explicit init_scale outside the bounds is an error, not a clamp: the user typed it,
        # and silently starting elsewhere would hide a mistake in the scale or the bounds. The
        # untyped default is clamped into the bounds instead.
        self._init_scale = validate_init_scale(
            init_scale, min_scale=self._min_scale, max_scale=self._max_scale
        )
        self._init_growth_tracker = 0
        self._init_hysteresis_tracker = self._hysteresis
        self.process_group = process_group
        if isinstance(distinct_dims, (str, bytes)):
            # frozenset("pp") would silently mean {"p"}.
            raise TypeError(
                f"distinct_dims takes a collection of mesh dimension names, got the string "
                f"{distinct_dims!r}; write e.g. distinct_dims=({distinct_dims!r},)"
            )
        self._distinct_dims = frozenset(distinct_dims)
        self._registry = registry
        self._kernels_name = kernels
        self._backend_spec = backend
        self._backend: CollectiveBackend | None = None
        if backend is not None:
            self._backend = self._reg().make_backend(backend)  # fail early on a bad name
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_tracker: torch.Tensor | None = None
        self._per_optimizer_states: dict[int, _OptimizerState] = {}
        self._step_count = 0
        self._last_grad_norm: torch.Tensor | None = None

    # -- plumbing ------------------------------------------------------------------------------

    def _reg(self) -> Registry:
        return self._registry if self._registry is not None else get_registry()

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
        state = self._per_optimizer_states.get(id(optimizer))
        if state is None:
            state = self._per_optimizer_states[id(optimizer)] = _OptimizerState()
        return state

    def _adapter_context(self) -> AdapterContext:
        backend = self.backend
        return AdapterContext(
            group=self.process_group,
            distinct_dims=self._distinct_dims,
            rank=backend.rank(self.process_group),
            world_size=backend.world_size(self.process_group),
        )

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scale is None or self._growth_tracker is None:
            raise ScalerStateError(
                f"{funcname}() was called before the scale exists: call scaler.scale(loss) "
                "(and backward) earlier in the iteration."
            )
        return self._scale, self._growth_tracker

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full(
            (), self._init_growth_tracker, dtype=torch.int32, device=dev
        )
        self._hysteresis_tracker = torch.full(
            (), self._init_hysteresis_tracker, dtype=torch.int32, device=dev
        )

    # -- scale ---------------------------------------------------------------------------------

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...
    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...
    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...
    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply a tensor (or nested lists/tuples of tensors) by the scale factor."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            assert self._scale is not None
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
                if val.device not in cache:
                    cache[val.device] = self._scale.to(device=val.device, non_blocking=True)
                return val * cache[val.device]
            if isinstance(val, (list, tuple)):
                return type(val)(apply(v) for v in val)
            if isinstance(val, Iterable) and not isinstance(val, (str, bytes)):
                return map(apply, val)
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    # -- unscale -------------------------------------------------------------------------------

    def _reduce_found_inf(
        self, per_device: list[torch.Tensor], scale: torch.Tensor
    ) -> tuple[torch.Tensor, Handle]:
        # Sum every device's flag on the scale's device and reduce once: one collective per step.
        found = torch.zeros((), dtype=torch.float32, device=scale.device)
        for flag in per_device:
            found += flag.to(scale.device, non_blocking=True).reshape(())
        try:
            handle = self.backend.all_reduce(found, op=ReduceOp.SUM, group=self.process_group)
        except Exception as exc:
            _note_found_inf(exc)
            raise
        return found, handle

    def _group_ranks(self) -> tuple[int, ...] | None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        return self.backend.group_ranks(self.process_group)

    def _unscale_grads(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """Unscale (or, with ``inv_scale=None``, only check) every local grad; per-device flags."""
        assert self._scale is not None
        registry = self._reg()
        buckets = collect_grads(
            optimizer_params(optimizer),
            self._adapter_context(),
            registry,
            group_ranks=self._group_ranks(),
        )
        for device in buckets.devices():
            # Checked before any grad is touched: a rejected call changes nothing.
            if device.type == "meta" or device.type not in (self._scale.device.type, "cpu"):
                raise ScalerStateError(
                    f"a gradient is on {device}, but this scaler was built for "
                    f"{self._device!r} and its scale lives on {self._scale.device}; move the "
                    f"parameters to {self._scale.device.type}, or build the scaler with "
                    f"device={device.type!r} and scale a loss on that device"
                    + (" (meta tensors hold no values to check)" if device.type == "meta" else "")
                )
        flags: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (device, _dtype), tensors in buckets.every.items():
                kernels = registry.kernels_for(device, self._kernels_name)
                if device not in flags:
                    flags[device] = torch.zeros((), dtype=torch.float32, device=device)
                if inv_scale is None:
                    # Read-only check: a non-finite value makes the max non-finite.
                    peak = kernels.partial_norm(tensors, math.inf)
                    flags[device] += (~torch.isfinite(peak)).to(torch.float32).to(device)
                else:
                    kernels.unscale_and_check_(
                        tensors, flags[device], inv_scale.to(device, non_blocking=True)
                    )
        return list(flags.values())

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale and agree on overflow across ranks.

        Optional, as in torch: call it to inspect or clip unscaled gradients
        before :meth:`step`. Raises if called twice for one optimizer between
        updates, or after ``step``.
        """
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._opt_state(optimizer)
        if state.stage is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() was already called on this optimizer since the last update(); "
                "call it at most once per optimizer per iteration."
            )
        if state.stage is OptState.STEPPED:
            raise RuntimeError(
                "unscale_() was called after step() for this optimizer; unscale before stepping, "
                "then call update() to start the next iteration."
            )
        inv_scale = scale.double().reciprocal().float()
        flags = self._unscale_grads(optimizer, inv_scale)
        state.found_inf, state.handle = self._reduce_found_inf(flags, scale)
        state.grad_scale = None
        state.stage = OptState.UNSCALED

    def _mark_unscaled(
        self,
        optimizer: torch.optim.Optimizer,
        found_inf: torch.Tensor,
        *,
        grad_scale: torch.Tensor | None = None,
        grad_norm: torch.Tensor | None = None,
    ) -> None:
        """Record that a fused pass (``unscale_and_clip_``) unscaled ``optimizer``'s grads.

        ``found_inf`` must already be reduced across ranks. ``grad_scale`` is set
        when the gradients were left scaled for a fused optimizer to divide by.
        """
        state = self._opt_state(optimizer)
        if state.stage is not OptState.READY:
            raise RuntimeError(
                f"optimizer is already {state.stage.name.lower()} in this iteration; "
                "unscale_and_clip_ must come before step() and at most once per update()."
            )
        state.found_inf, state.handle = found_inf, None
        state.grad_scale = grad_scale
        state.stage = OptState.UNSCALED
        self._last_grad_norm = grad_norm

    def _found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """The reduced overflow flag of ``optimizer`` in this iteration (0-dim float32)."""
        return self._opt_state(optimizer).reduced_found_inf()

    # -- step ----------------------------------------------------------------------------------

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
        scale, _ = self._check_scale_growth_tracker("step")
        state = self._opt_state(optimizer)
        if state.stage is OptState.STEPPED:
            raise RuntimeError(
                "step() was already called for this optimizer since the last update(); call "
                "scaler.update() once per iteration after stepping every optimizer."
            )
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, state, scale, args, kwargs)
        if state.stage is OptState.READY:
            self.unscale_(optimizer)
        found_inf = state.reduced_found_inf()
        retval = None
        # The one host sync of an unfused step: the optimizer runs on the host's say-so.
        if not found_inf.item():
            retval = optimizer.step(*args, **kwargs)
        state.stage = OptState.STEPPED
        return retval

    def _fused_step(
        self,
        optimizer: torch.optim.Optimizer,
        state: _OptimizerState,
        scale: torch.Tensor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        # Fused optimizers unscale and skip on device: no host sync, no separate unscale pass.
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            raise ShardscaleError(
                "this optimizer's step() takes the deprecated grad_scaler= argument; shardscale "
                "hands fused optimizers grad_scale/found_inf attributes instead. Update the "
                "optimizer to read optimizer.grad_scale and optimizer.found_inf."
            )
        if state.stage is OptState.READY:
            flags = self._unscale_grads(optimizer, None)
            state.found_inf, state.handle = self._reduce_found_inf(flags, scale)
            grad_scale: torch.Tensor | None = scale * getattr(optimizer, "grad_scale", 1)
        elif state.grad_scale is not None:
            grad_scale = state.grad_scale
        else:
            grad_scale = getattr(optimizer, "grad_scale", None)
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = state.reduced_found_inf()  # type: ignore[attr-defined]
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        state.stage = OptState.STEPPED
        return retval

    # -- update --------------------------------------------------------------------------------

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back the scale off if any optimizer overflowed, grow it after ``growth_interval`` clean steps.

        ``new_scale`` sets the scale directly instead (a Python float, or a
        one-element tensor on the scaler's device type).
        """
        if not self._enabled:
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            self._set_scale(scale, new_scale)
            found = None
        else:
            found_list = [
                s.reduced_found_inf()
                for s in self._per_optimizer_states.values()
                if s.found_inf is not None
            ]
            if not found_list:
                raise ScalerStateError(
                    "update() found no overflow checks this iteration: call scaler.step(optimizer) "
                    "(or unscale_) for at least one optimizer before update()."
                )
            found = found_list[0].to(scale.device).clone()
            for extra in found_list[1:]:
                found += extra.to(scale.device)
            self._update_scale(scale, tracker, found)
        self._per_optimizer_states = {}
        self._step_count += 1
        if found is not None and self._reg().has_step_observers():
            assert self._growth_tracker is not None
            record = StepRecord(
                step=self._step_count,
                scale=self._scale.clone() if self._scale is not None else scale,
                found_inf=found,
                skipped=found > 0,
                growth_tracker=self._growth_tracker.clone(),
                grad_norm=self._last_grad_norm,
            )
            self._reg().notify_step(record)
        self._last_grad_norm = None

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
        if self._hysteresis != 1:
            state["hysteresis"] = self._hysteresis
            state["_hysteresis_tracker"] = self._get_hysteresis_tracker()
        if self._min_scale is not None:
            state["min_scale"] = self._min_scale
        if self._max_scale is not None:
            state["max_scale"] = self._max_scale
        return state

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
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(self._init_growth_tracker)
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)

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
        state["_backend"] = None  # rebuilt from the spec on first use
        if not isinstance(state["_backend_spec"], (str, type(None))):
            state["_backend_spec"] = None
        state["_registry"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
