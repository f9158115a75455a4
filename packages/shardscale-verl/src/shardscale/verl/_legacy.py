"""``use_shardscale(actor)``: verl 0.7's legacy ``DataParallelPPOActor`` scales, clips and skips through shardscale.

verl 0.7's actor (``verl/workers/actor/dp_actor.py``) creates torch's
``ShardedGradScaler(growth_interval=400)`` when its FSDP ``dtype`` is fp16,
scales the loss with ``self.scaler.scale(loss).backward()`` in
``update_policy``, and steps in ``_optimizer_step``: ``scaler.unscale_``,
verl's clip (FSDP1's ``clip_grad_norm_`` or ``fsdp2_clip_grad_norm_``),
``scaler.step``, ``scaler.update``; ``update_policy`` logs the returned norm as
``actor/grad_norm``. What ``use_shardscale`` changes, on that actor instance
only (nothing in torch, nothing class-wide in verl):

* ``actor.scaler`` becomes a :class:`shardscale.core.ShardedGradScaler` on
  verl's device; verl's own ``update_policy`` scales the loss with it.
* ``actor._optimizer_step`` is ``unscale_and_clip_`` with the actor config's
  ``grad_clip`` (the overflow and the true global norm in one collective), then
  ``scaler.step`` + ``scaler.update``; it returns the norm (a 0-dim CPU tensor
  read once with the scale and the skip flag), which verl logs as
  ``actor/grad_norm``.
* ``actor.update_policy`` is verl's, plus ``actor/loss_scale`` and
  ``actor/step_skipped`` in its metrics: one value per optimizer step, beside
  ``actor/grad_norm``'s (the trainer averages them: the fraction skipped).
* With ``checkpoint_manager=``, that ``FSDPCheckpointManager``'s
  ``save_checkpoint``/``load_checkpoint`` are verl's plus one small file per rank
  (``shardscale_world_size_W_rank_R.pt``: the scaler's state and the skip
  counters), read back before verl loads the rest.

verl 0.7's worker steps the learning-rate scheduler itself (``update_actor``),
outside the actor: it is not held on skipped steps (see docs/verl.md).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from shardscale.core import ShardedGradScaler
from shardscale.verl._contract import check_verl
from shardscale.verl._install import (
    _STATE,
    ShardscaleEngineState,
    check_scaler_arguments,
    engine_state,
    is_using_shardscale,
    load_state,
    prepare_scaler,
    save_state,
    scaled_step,
)

__all__ = ["LEGACY_METRIC_KEYS", "use_shardscale_on_actor"]

#: The metrics ``use_shardscale(actor)`` adds to what ``actor.update_policy`` returns.
LEGACY_METRIC_KEYS = ("actor/loss_scale", "actor/step_skipped")


def _actor_optimizer_step(self: Any) -> torch.Tensor:
    norm = scaled_step(engine_state(self), self.actor_optimizer, float(self.config.grad_clip))
    # verl calls .detach().item() on it: a CPU tensor costs no second device read.
    return torch.tensor(norm, dtype=torch.float64)


def _update_policy(self: Any, data: Any) -> Any:
    state = engine_state(self)
    state.log.clear()
    metrics = type(self).update_policy(self, data)
    log, state.log = state.log, []
    if log:
        metrics.setdefault(LEGACY_METRIC_KEYS[0], []).extend(scale for scale, _ in log)
        metrics.setdefault(LEGACY_METRIC_KEYS[1], []).extend(float(s) for _, s in log)
    return metrics


#: The actor methods use_shardscale replaces, and with what: a constant table (read-only).
_REPLACED: Mapping[str, Any] = MappingProxyType(
    {"_optimizer_step": _actor_optimizer_step, "update_policy": _update_policy}
)


def _manager_save(
    state: ShardscaleEngineState,
    manager: Any,
    local_path: str | None,
    hdfs_path: str | None = None,
    global_step: int = 0,
    max_ckpt_to_keep: int | None = None,
    **kwargs: Any,
) -> None:
    type(manager).save_checkpoint(
        manager, local_path, hdfs_path, global_step, max_ckpt_to_keep, **kwargs
    )
    save_state(state, local_path)


def _manager_load(
    state: ShardscaleEngineState,
    manager: Any,
    local_path: str | None,
    hdfs_path: str | None = None,
    del_local_after_load: bool = False,
    **kwargs: Any,
) -> None:
    load_state(state, local_path)
    type(manager).load_checkpoint(manager, local_path, hdfs_path, del_local_after_load, **kwargs)


def _check_manager(actor: Any, manager: Any) -> None:
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    if not isinstance(manager, FSDPCheckpointManager):
        raise TypeError(
            "checkpoint_manager takes verl's FSDPCheckpointManager (verl.utils.checkpoint."
            f"fsdp_checkpoint_manager), got {type(manager).__name__}"
        )
    if getattr(manager, "optimizer", None) is not actor.actor_optimizer:
        raise ValueError(
            "checkpoint_manager saves another optimizer than this actor's: pass the manager "
            "built with optimizer=actor.actor_optimizer (verl's worker: self.checkpoint_manager)."
        )
    if "save_checkpoint" in vars(manager) or "load_checkpoint" in vars(manager):
        raise RuntimeError(
            "this checkpoint manager's save_checkpoint/load_checkpoint were already replaced "
            "(by use_shardscale for another actor, or by something else)."
        )


def use_shardscale_on_actor(
    actor: Any,
    *,
    scaler: ShardedGradScaler | None = None,
    checkpoint_manager: Any | None = None,
    **scaler_options: Any,
) -> ShardedGradScaler:
    """``use_shardscale`` for verl 0.7's ``DataParallelPPOActor`` (it dispatches here).

    See the module docstring for what changes, and :func:`shardscale.verl.use_shardscale`
    for the arguments. Every check runs before the actor or the manager is touched.
    """
    check_scaler_arguments(scaler, scaler_options)
    if is_using_shardscale(actor):
        if scaler is not None or scaler_options or checkpoint_manager is not None:
            raise RuntimeError(
                "use_shardscale was already applied to this actor; its scaler is actor.scaler "
                "(pass options and checkpoint_manager the first time only)."
            )
        return engine_state(actor).scaler
    if not isinstance(getattr(actor, "actor_optimizer", None), torch.optim.Optimizer):
        raise RuntimeError(
            "use_shardscale(actor) needs the training actor, built with an optimizer "
            "(a reference policy, DataParallelPPOActor(config, module) alone, has nothing to scale)."
        )
    check_verl(actor)
    if getattr(actor.actor_module, "_qat_fuse_enabled", False):
        raise ValueError(
            "use_shardscale does not support verl's QAT (its optimizer step also resets "
            "quantization scales); train without QAT or without use_shardscale."
        )
    if checkpoint_manager is not None:
        _check_manager(actor, checkpoint_manager)
    scaler = prepare_scaler("actor", actor.scaler, scaler, scaler_options)
    state = ShardscaleEngineState(scaler)
    actor.scaler = scaler
    actor.__dict__[_STATE] = state
    # Instance attributes shadow the class's methods for this actor only.
    for name, function in _REPLACED.items():
        setattr(actor, name, types.MethodType(function, actor))
    if checkpoint_manager is not None:
        checkpoint_manager.save_checkpoint = functools.partial(
            _manager_save, state, checkpoint_manager
        )
        checkpoint_manager.load_checkpoint = functools.partial(
            _manager_load, state, checkpoint_manager
        )
    return scaler
