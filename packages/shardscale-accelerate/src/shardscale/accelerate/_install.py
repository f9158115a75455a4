"""``use_shardscale(accelerator)``: make one ``Accelerator`` scale and clip through shardscale.

What it changes, on that instance only (see [Note: why a contract check]):

* ``accelerator.scaler`` becomes a :class:`shardscale.core.ShardedGradScaler`
  (built from the ``GradScalerKwargs`` handler, if any). Accelerate itself then
  uses it in ``backward``, hands it to every ``AcceleratedOptimizer`` it
  prepares, and saves/loads its ``state_dict`` in ``save_state``/``load_state``.
* ``prepare_optimizer`` returns optimizers of a subclass,
  :class:`ShardscaleAcceleratedOptimizer`, whose ``step`` is ``scaler.step``
  with ONE scaler update per iteration however many optimizers step (see
  [Note: one update per iteration], in shardscale.core: the iteration ends
  after a step when no prepared optimizer is still due, else when
  ``accelerator.backward`` runs again or an optimizer that already stepped is
  unscaled, clipped or stepped again), and whose ``step_was_skipped`` is that
  optimizer's own skip flag, read only when asked (Accelerate derives it from
  whether ``optimizer.step`` was called, which a fused optimizer always is).
* ``prepare_scheduler`` returns schedulers of a subclass,
  :class:`ShardscaleAcceleratedScheduler`,
  that holds on skipped steps without reading the skip flag on the host (see
  [Note: the prepared scheduler's deferred decision]).
* ``backward`` first ends an iteration whose update is still pending.
* ``unscale_gradients`` unscales each optimizer at most once per iteration,
  whenever the scaler is enabled (Accelerate only does on an fp16
  ``native_amp`` device).
* ``clip_grad_norm_`` is ``unscale_and_clip_`` when the parameters are those of
  one prepared optimizer (one read, one collective, fused optimizers included),
  else unscale every optimizer once + ``ShardedGradScaler.clip_grad_norm_``
  (the scaler's whole configuration); both the true global norm.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from shardscale.accelerate._contract import check_accelerate
from shardscale.accelerate._scheduler import hold_prepared_scheduler
from shardscale.clip import unscale_and_clip_
from shardscale.core import ShardedGradScaler
from shardscale.core.scaler import Iteration
from shardscale.core.step import optimizer_params

__all__ = ["ShardscaleAcceleratedOptimizer", "use_shardscale", "is_using_shardscale"]

# Accelerate paths whose scaler and clipping are Accelerate's own to run.
_REFUSED = {
    DistributedType.DEEPSPEED: "DeepSpeed scales and clips inside its engine",
    DistributedType.MEGATRON_LM: "Megatron-LM scales and clips inside its optimizer",
    DistributedType.XLA: "XLA has its own scaler (torch_xla.amp)",
}


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer an ``AcceleratedOptimizer`` wraps."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer  # type: ignore[no-any-return]


class _Iteration(Iteration):
    """The scaler's iteration over the optimizers one ``Accelerator`` prepared."""

    def __init__(self, scaler: ShardedGradScaler, prepared: list[Any]) -> None:
        super().__init__(scaler)
        self.prepared = prepared  # the Accelerator's own list: optimizers prepared later too

    def any_due(self) -> bool:
        """Whether a prepared optimizer has still to step before the update."""
        return self.due(map(_inner, self.prepared))


class ShardscaleAcceleratedOptimizer(AcceleratedOptimizer):  # type: ignore[misc]
    """An ``AcceleratedOptimizer`` that steps through the scaler once per iteration.

    ``step`` is ``scaler.step``; the scaler's ``update`` follows once the
    iteration is over (see [Note: one update per iteration], so several
    optimizers are each unscaled once and back the scale off once).
    ``step_was_skipped`` is this optimizer's own skip decision, turned into a
    bool when read (one host read, already paid by an unfused step), so a fused
    optimizer's skipped step is reported and a scheduler prepared by Accelerate
    holds.
    """

    _shardscale_iteration: _Iteration

    def step(self, closure: Any = None) -> None:
        """``scaler.step`` of the wrapped optimizer; the scaler's update when the iteration is over."""
        scaler = self.scaler
        if (
            not isinstance(scaler, ShardedGradScaler)
            or not scaler.is_enabled()
            or not self.gradient_state.sync_gradients
        ):
            super().step(closure)  # Accelerate's own: a plain step, or nothing while accumulating
            return
        it = self._shardscale_iteration
        if it.has_stepped(self.optimizer):
            it.end()  # stepped again without a new backward: the previous iteration is over
        kwargs = {} if closure is None else {"closure": closure}  # the scaler refuses closures
        _, self._shardscale_skipped = it.step(self.optimizer, **kwargs)
        if not it.any_due():
            it.end()

    @property
    def skip_flag(self) -> torch.Tensor | None:
        """This optimizer's last skip flag as a 0-dim device tensor (no host read), or ``None``."""
        flag: torch.Tensor | None = getattr(self, "_shardscale_skipped", None)
        if flag is None and isinstance(self.scaler, ShardedGradScaler):
            flag = self.scaler.last_step_skipped  # an optimizer whose own flag is unknowable
        return flag

    @property
    def step_was_skipped(self) -> bool:
        """Whether this optimizer's last synchronised step was skipped on every rank (any reason)."""
        flag = self.skip_flag
        return bool(flag) if flag is not None else False


def _iteration(accelerator: Accelerator) -> _Iteration:
    it: _Iteration = accelerator.__dict__["_shardscale_iteration"]
    return it


def _prepare_optimizer(
    self: Accelerator, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
) -> Any:
    prepared = type(self).prepare_optimizer(self, optimizer, device_placement=device_placement)
    if type(prepared) is AcceleratedOptimizer:
        prepared.__class__ = ShardscaleAcceleratedOptimizer  # same state, our step/skip signal
        prepared._shardscale_iteration = _iteration(self)
    return prepared


def _skip_flag(optimizer: Any) -> torch.Tensor | bool | None:
    """A prepared optimizer's flag for the scheduler; ``False`` for one not ours (Accelerate asks it)."""
    if isinstance(optimizer, ShardscaleAcceleratedOptimizer):
        return optimizer.skip_flag
    return False


def _prepare_scheduler(self: Accelerator, scheduler: Any) -> Any:
    prepared = type(self).prepare_scheduler(self, scheduler)
    return hold_prepared_scheduler(prepared, _skip_flag)  # same state, a deferred hold


def _backward(self: Accelerator, loss: torch.Tensor, **kwargs: Any) -> None:
    it = _iteration(self)
    if it.stepped:
        it.end()  # a backward after a step: the new gradients carry the next iteration's scale
    type(self).backward(self, loss, **kwargs)


def _unscale_gradients(self: Accelerator, optimizer: Any = None) -> None:
    scaler = self.scaler
    if not isinstance(scaler, ShardedGradScaler) or not scaler.is_enabled():
        return
    if optimizer is None:
        optimizers = list(self._optimizers)
    elif isinstance(optimizer, (list, tuple)):
        optimizers = list(optimizer)
    else:
        optimizers = [optimizer]
    it = _iteration(self)
    for opt in map(_inner, optimizers):
        if it.has_stepped(opt):
            it.end()
        it.unscale_(opt)  # each optimizer once per iteration, as torch requires


def _clip_grad_norm_(
    self: Accelerator, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
) -> torch.Tensor:
    scaler = self.scaler
    assert isinstance(scaler, ShardedGradScaler)
    it = _iteration(self)
    params = list(parameters)
    wanted = {id(p) for p in params if p.grad is not None}
    if wanted:
        for prepared in self._optimizers:
            opt = _inner(prepared)
            if {id(p) for p in optimizer_params(opt) if p.grad is not None} != wanted:
                continue
            if it.has_stepped(opt):
                it.end()
            if id(opt) not in it.unscaled:
                # The usual case (clip_grad_norm_(model.parameters(), ...)): one fused pass.
                # The user's code (and transformers' on_pre_optimizer_step callbacks) runs
                # between this clip and the step: leave the gradients unscaled.
                norm = unscale_and_clip_(
                    scaler, opt, float(max_norm), float(norm_type), fuse_optimizer=False
                )
                it.mark_unscaled(opt)  # not while disabled: its iterations are never recorded
                return norm
    # Several optimizers' parameters, a subset, or gradients already unscaled: unscale every
    # optimizer once (as Accelerate does), then clip exactly these with the scaler's config.
    self.unscale_gradients()
    return scaler.clip_grad_norm_(params, float(max_norm), float(norm_type))


#: The accelerator's ``__dict__`` key of the first call's request (see ``_check_repeat``).
_REQUEST = "_shardscale_request"


@dataclass(frozen=True)
class _Request:
    """What the first ``use_shardscale`` call on an accelerator was given."""

    given_scaler: bool
    options: dict[str, Any]


def _same(a: object, b: object) -> bool:
    if a is b:
        return True
    numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in (a, b))
    try:
        return (numbers or type(a) is type(b)) and bool(a == b)  # 4096 is 2.0**12
    except Exception:  # an option whose == is not a plain bool (a tensor, say): not the same
        return False


def _describe(options: dict[str, Any], keys: list[str]) -> str:
    shown = [f"{k}={options[k]!r}" for k in keys if k in options]
    return ", ".join(shown) if shown else "no such options"


def _check_repeat(
    first: _Request | None,
    scaler: ShardedGradScaler | None,
    options: dict[str, Any],
    existing: ShardedGradScaler,
) -> None:
    """A repeated call returns the first call's scaler if it asks for nothing else; else raise.

    The same scaler object, the same options (or none at all) are "the same
    again"; another scaler or other options would be silently ignored, so they
    are refused, naming what differs.
    """
    where = "accelerator.scaler (trainer.accelerator.scaler for a Trainer)"
    if scaler is not None:
        if scaler is existing:
            return
        raise RuntimeError(
            "use_shardscale was already applied here, and this call passes another scaler; "
            f"the one in use is {where}. Call it again with no arguments (or the same ones) "
            "to get it back, or build a new Accelerator/Trainer for another scaler."
        )
    if not options:
        return
    if first is None or first.given_scaler:
        raise RuntimeError(
            "use_shardscale was already applied here with a scaler you built, and this call "
            f"passes options ({', '.join(sorted(options))}); the scaler in use is {where}. "
            "Call it again with no arguments to get it back."
        )
    keys = sorted(options.keys() | first.options.keys())
    differ = [
        k
        for k in keys
        if (k in options) != (k in first.options)
        or (k in options and not _same(options[k], first.options[k]))
    ]
    if differ:
        raise RuntimeError(
            f"use_shardscale was already applied here with {_describe(first.options, differ)}; "
            f"this call asks for {_describe(options, differ)}. The scaler in use is {where}, "
            "and its options are set once: call it again with the same options (or none) to "
            "get it back, or build a new Accelerator/Trainer for other options."
        )


def is_using_shardscale(accelerator: Accelerator) -> bool:
    """Whether :func:`use_shardscale` was applied to ``accelerator``."""
    return isinstance(accelerator.__dict__.get("scaler"), ShardedGradScaler) and isinstance(
        accelerator.__dict__.get("clip_grad_norm_"), types.MethodType
    )


def use_shardscale(
    accelerator: Accelerator,
    *,
    scaler: ShardedGradScaler | None = None,
    **scaler_options: Any,
) -> ShardedGradScaler:
    """Make ``accelerator`` use shardscale's loss scaler and global-norm clipping.

    Call it once, right after creating the ``Accelerator`` and before
    ``accelerator.prepare(...)``::

        accelerator = Accelerator(mixed_precision="fp16")
        use_shardscale(accelerator)          # the one added line
        model, optimizer, sched = accelerator.prepare(model, optimizer, sched)

    Then ``accelerator.backward``, ``accelerator.clip_grad_norm_``,
    ``optimizer.step()``, ``accelerator.optimizer_step_was_skipped``, the
    prepared scheduler and ``save_state``/``load_state`` all go through the
    returned :class:`ShardedGradScaler`: every rank skips the same steps (fused
    optimizers, FSDP2 with several meshes or mixed DTensor/plain parameters
    included), the scheduler holds on them, and clipping uses the true global
    norm with one collective. Supported for Accelerate's single-process, DDP
    (multi-GPU and multi-CPU) and FSDP paths.

    Args:
        accelerator: a fresh ``Accelerator`` (nothing prepared yet).
        scaler: a ready scaler; default: one on ``accelerator.device``, enabled
            for ``mixed_precision="fp16"`` or with ``loss_scaling=False``, built
            from the ``GradScalerKwargs`` handler and ``scaler_options``.
        scaler_options: keyword arguments of ``ShardedGradScaler``
            (``init_scale``, ``growth_interval``, ``backend``, ``enabled``, ...),
            including the skip policies: ``spike=SpikeSkip(...)``,
            ``check_loss=True``, ``max_consecutive_skips=N``, and
            ``loss_scaling=False``, which with ``mixed_precision="bf16"`` or
            ``"no"`` turns the scaler on as the skip guard alone (scale 1: a
            step with a non-finite gradient, or a policy's reason, is skipped
            on every rank and the prepared scheduler holds).

    Returns:
        The scaler, also at ``accelerator.scaler``. Read its scale without a
        host sync through ``scaler.scale_tensor`` (``get_scale()`` syncs). A
        second call with the same options (or none, or the same ``scaler``)
        returns the same scaler.

    Raises:
        AccelerateContractError: the installed Accelerate changed what this relies on.
        RuntimeError: ``accelerator.prepare`` already ran for an optimizer, or a
            second call asks for other options or another scaler than the first.
        ValueError: the path is DeepSpeed, Megatron-LM or XLA.
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"use_shardscale takes an accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    check_accelerate(accelerator)
    if scaler is not None and not isinstance(scaler, ShardedGradScaler):
        raise TypeError(
            f"use_shardscale(scaler=...) takes a shardscale.core.ShardedGradScaler, got "
            f"{type(scaler).__name__}; pass its arguments as keywords instead."
        )
    if scaler is not None and scaler_options:
        raise ValueError(
            f"pass either a scaler or scaler options, not both (got {sorted(scaler_options)})"
        )
    reason = _REFUSED.get(accelerator.distributed_type)
    if reason is not None:
        raise ValueError(
            f"use_shardscale does not support Accelerate's {accelerator.distributed_type} path: "
            f"{reason}. Use it with DDP (multi-GPU/CPU), FSDP or a single process."
        )
    if is_using_shardscale(accelerator):
        existing: ShardedGradScaler = accelerator.scaler
        _check_repeat(accelerator.__dict__.get(_REQUEST), scaler, scaler_options, existing)
        return existing
    if accelerator._optimizers:
        raise RuntimeError(
            "use_shardscale(accelerator) must run before accelerator.prepare(...): "
            f"{len(accelerator._optimizers)} optimizer(s) were already prepared with "
            "Accelerate's scaler. Call it right after Accelerator(...)."
        )
    given = scaler is not None
    if scaler is None:
        options: dict[str, Any] = {}
        if accelerator.scaler_handler is not None:
            options.update(accelerator.scaler_handler.to_kwargs())
        options.update(scaler_options)
        # fp16 scales the loss; any precision gets the skip guard alone with loss_scaling=False.
        guard = options.get("loss_scaling") is False
        options.setdefault("enabled", accelerator.mixed_precision == "fp16" or guard)
        scaler = ShardedGradScaler(accelerator.device.type, **options)
    accelerator.scaler = scaler
    # What this call asked for, so a repeated call can tell "the same again" from a change.
    accelerator.__dict__[_REQUEST] = _Request(given_scaler=given, options=dict(scaler_options))
    accelerator.__dict__["_shardscale_iteration"] = _Iteration(scaler, accelerator._optimizers)
    # Instance attributes shadow the class's methods for this accelerator only.
    accelerator.prepare_optimizer = types.MethodType(_prepare_optimizer, accelerator)  # type: ignore[method-assign]
    accelerator.prepare_scheduler = types.MethodType(_prepare_scheduler, accelerator)  # type: ignore[method-assign]
    accelerator.backward = types.MethodType(_backward, accelerator)  # type: ignore[method-assign]
    accelerator.unscale_gradients = types.MethodType(_unscale_gradients, accelerator)  # type: ignore[method-assign]
    accelerator.clip_grad_norm_ = types.MethodType(_clip_grad_norm_, accelerator)  # type: ignore[method-assign]
    return scaler
