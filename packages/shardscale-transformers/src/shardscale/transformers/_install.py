"""``use_shardscale(trainer)``: put one 🤗 ``Trainer`` (or a TRL trainer) on shardscale.

What it changes, on that Trainer only (see [Note: the Trainer's contract]):

* ``trainer.accelerator`` goes through ``shardscale.accelerate.use_shardscale``:
  a :class:`shardscale.core.ShardedGradScaler` as ``accelerator.scaler`` (which
  the Trainer saves as ``scaler.pt`` in every checkpoint and loads on resume),
  ``accelerator.clip_grad_norm_`` as one ``unscale_and_clip_``, and an
  ``optimizer_step_was_skipped`` that is the scaler's agreed decision, so the
  Trainer's ``lr_scheduler.step()`` holds on skipped steps, fused optimizers
  included.
* ``trainer._clip_grad_norm`` and ``trainer._get_grad_norm`` always go through
  ``accelerator.clip_grad_norm_``: the Trainer's own multi-mesh path neither
  unscales nor reaches the scaler. So ``max_grad_norm`` is one
  ``unscale_and_clip_`` and the logged ``grad_norm`` is the true global norm.
* a :class:`ShardscaleCallback` records the skipped steps in ``trainer.state``
  and adds ``loss_scale``/``skipped_steps`` to the training logs.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from transformers import Trainer

from shardscale.accelerate import is_using_shardscale as _accelerator_uses_shardscale
from shardscale.accelerate import use_shardscale as _use_shardscale_on_accelerator
from shardscale.core import ShardedGradScaler
from shardscale.transformers._callback import ShardscaleCallback
from shardscale.transformers._contract import check_transformers

__all__ = ["use_shardscale", "is_using_shardscale"]


def _clip_grad_norm(self: Trainer, model: torch.nn.Module) -> torch.Tensor:
    norm: torch.Tensor = self.accelerator.clip_grad_norm_(
        model.parameters(), self.args.max_grad_norm
    )
    return norm


def _get_grad_norm(
    self: Trainer, model: torch.nn.Module, grad_norm: torch.Tensor | float | None = None
) -> torch.Tensor | float:
    if grad_norm is not None:
        return grad_norm
    # No clipping asked for: the norm alone, still unscaled first (one read, one collective).
    norm: torch.Tensor = self.accelerator.clip_grad_norm_(model.parameters(), float("inf"))
    return norm


def is_using_shardscale(trainer: Trainer) -> bool:
    """Whether :func:`use_shardscale` was applied to ``trainer`` (and its current accelerator)."""
    return (
        _accelerator_uses_shardscale(trainer.accelerator)
        and isinstance(trainer.__dict__.get("_clip_grad_norm"), types.MethodType)
        and any(isinstance(cb, ShardscaleCallback) for cb in trainer.callback_handler.callbacks)
    )


def use_shardscale(
    trainer: Trainer,
    *,
    scaler: ShardedGradScaler | None = None,
    **scaler_options: Any,
) -> ShardedGradScaler:
    """Make ``trainer`` scale, clip and skip through shardscale.

    Call it after building the Trainer and before ``trainer.train()``::

        trainer = Trainer(model=model, args=TrainingArguments(..., fp16=True), ...)
        use_shardscale(trainer)          # the one added line
        trainer.train()

    TRL's trainers (``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, ...) are
    Trainers and take the same line. Then every rank skips the same steps
    (fused optimizers and sharded layouts included), the learning-rate
    scheduler holds on them, ``max_grad_norm`` clips by the true global norm
    in one ``unscale_and_clip_`` (one read of each gradient, one collective),
    the logged ``grad_norm`` is that norm, the scaler's state is saved in and
    resumed from Trainer checkpoints (``scaler.pt``), and
    ``trainer.state.stateful_callbacks["ShardscaleCallback"]`` lists the
    skipped steps (also in every checkpoint's ``trainer_state.json``).

    Args:
        trainer: a ``transformers.Trainer`` (or subclass) that has not trained yet.
        scaler: a ready scaler; default: one enabled for ``fp16=True``, built
            from the ``GradScalerKwargs`` handler and ``scaler_options``.
        scaler_options: keyword arguments of ``ShardedGradScaler``
            (``init_scale``, ``growth_interval``, ``backend``, ...).

    Returns:
        The scaler, also at ``trainer.accelerator.scaler``. A second call with the
        same options (or none, or the same ``scaler``) returns the same scaler.

    Raises:
        TransformersContractError: the installed transformers changed what this relies on.
        AccelerateContractError: the installed Accelerate did.
        RuntimeError: the Trainer already trained (its optimizer was prepared), or a
            second call asks for other options or another scaler than the first.
        ValueError: the Trainer runs on DeepSpeed, Megatron-LM or XLA, or SageMaker MP.
    """
    if not isinstance(trainer, Trainer):
        raise TypeError(
            f"use_shardscale takes a transformers.Trainer, got {type(trainer).__name__} "
            "(for an accelerate.Accelerator, use shardscale.accelerate.use_shardscale)"
        )
    check_transformers(trainer)
    from transformers.utils.import_utils import is_sagemaker_mp_enabled

    if is_sagemaker_mp_enabled():
        raise ValueError(
            "use_shardscale does not support SageMaker model parallelism: its optimizer "
            "scales and clips itself. Use it with DDP, FSDP or a single process."
        )
    if is_using_shardscale(trainer):
        # A repeat: the same scaler back when asking for the same (or nothing), an error
        # naming what differs otherwise (the accelerator remembers the first call).
        return _use_shardscale_on_accelerator(trainer.accelerator, scaler=scaler, **scaler_options)
    if getattr(trainer.accelerator, "_optimizers", None):  # (its absence: Accelerate's check)
        raise RuntimeError(
            "use_shardscale(trainer) must run before trainer.train(): this Trainer already "
            "prepared its optimizer with Accelerate's scaler. Call it right after Trainer(...)."
        )
    # Validates everything else (types, options, the Accelerate path, "prepared already")
    # before anything changes, and changes the accelerator.
    result = _use_shardscale_on_accelerator(trainer.accelerator, scaler=scaler, **scaler_options)
    trainer._clip_grad_norm = types.MethodType(_clip_grad_norm, trainer)  # type: ignore[method-assign]
    trainer._get_grad_norm = types.MethodType(_get_grad_norm, trainer)  # type: ignore[method-assign]
    if not any(isinstance(cb, ShardscaleCallback) for cb in trainer.callback_handler.callbacks):
        # First, so that reporting callbacks (TensorBoard, W&B, ...) see the keys it adds.
        trainer.callback_handler.callbacks.insert(0, ShardscaleCallback())
    return result
