"""``use_shardscale(engine)``: make one verl FSDP engine scale, clip and skip through shardscale.

What it changes, on that engine instance only (see [Note: why a contract
check] in ``_contract``); nothing in torch, nothing class-wide in verl:

* ``engine.scaler`` becomes a :class:`shardscale.core.ShardedGradScaler` on
  verl's device. verl's own ``forward_backward_batch`` reads this attribute and
  runs ``scaler.scale(loss).backward()``, so the loss is scaled by ours.
* ``engine.optimizer_step`` is ``unscale_and_clip_`` with the optimizer
  config's ``clip_grad`` (one read of each gradient, one collective: the
  overflow and the true global norm agree on every rank), then
  ``scaler.step`` + ``scaler.update``. It returns the global norm as a float,
  which verl's ``train_batch`` logs as ``grad_norm`` (``actor/grad_norm`` in
  the trainer); one host read per step, as verl's own ``.item()``.
* ``engine.train_batch`` is verl's, plus two metrics beside ``grad_norm``:
  ``loss_scale`` (the scale this step's loss was multiplied by) and
  ``step_skipped`` (1.0 when the optimizer step was skipped on every rank,
  else 0.0); the trainer logs them as ``actor/loss_scale`` and
  ``actor/step_skipped`` (averaged over the step's mini-batches: the fraction
  of its optimizer steps that were skipped).
* ``engine.lr_scheduler_step`` holds the scheduler (returns the current
  learning rate without advancing it) when every optimizer step since the
  previous scheduler step was skipped. verl steps its scheduler once per RL
  step, after the last mini-batch's optimizer step, so the schedule counts RL
  steps that changed the policy.
* ``engine.save_checkpoint`` / ``load_checkpoint`` are verl's, plus one small
  file per rank beside verl's own (``shardscale_world_size_W_rank_R.pt``: the
  scaler's ``state_dict`` and the skip counters), read back before verl loads
  the rest.
"""

from __future__ import annotations

import os
import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from shardscale.clip import unscale_and_clip_
from shardscale.core import ShardedGradScaler
from shardscale.verl._contract import check_verl, target_kind

__all__ = [
    "METRIC_KEYS",
    "ShardscaleEngineState",
    "engine_state",
    "is_using_shardscale",
    "use_shardscale",
]

#: The metrics ``use_shardscale`` adds to what ``engine.train_batch`` returns.
METRIC_KEYS = ("loss_scale", "step_skipped")

_STATE = "_shardscale_verl"
_FILE = "shardscale_world_size_{world}_rank_{rank}.pt"
_COUNTERS = ("optimizer_steps", "skipped_steps", "held_scheduler_steps")


@dataclass
class ShardscaleEngineState:
    """What ``use_shardscale`` keeps for one engine (``engine_state(engine)`` returns it).

    Attributes:
        scaler: the engine's :class:`~shardscale.core.ShardedGradScaler`.
        optimizer_steps: optimizer steps run through the scaler (taken or skipped).
        skipped_steps: how many of them were skipped (on every rank).
        held_scheduler_steps: scheduler steps held because every optimizer step
            since the previous one was skipped.
        last_loss_scale: the scale the last step's loss was multiplied by.
        last_skipped: whether the last optimizer step was skipped.
    """

    scaler: ShardedGradScaler
    optimizer_steps: int = 0
    skipped_steps: int = 0
    held_scheduler_steps: int = 0
    last_loss_scale: float | None = None
    last_skipped: bool | None = None
    # Optimizer steps since the last scheduler step, and how many of them were taken.
    pending: list[int] = field(default_factory=lambda: [0, 0])
    # (loss scale, skipped) of each optimizer step since the caller last cleared it.
    log: list[tuple[float, bool]] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state and the counters, as plain Python values."""
        state: dict[str, Any] = {name: getattr(self, name) for name in _COUNTERS}
        state["scaler"] = self.scaler.state_dict()
        state["pending"] = list(self.pending)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` wrote; a malformed dict changes nothing."""
        if not isinstance(state, dict):
            raise TypeError(f"a shardscale.verl state is a dict, got {type(state).__name__}")
        missing = [k for k in (*_COUNTERS, "scaler", "pending") if k not in state]
        if missing:
            raise ValueError(f"the shardscale.verl state has no {missing}: not written by it")
        for name in _COUNTERS:
            value = state[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"the shardscale.verl state's {name!r} must be an int >= 0")
        pending = state["pending"]
        if not (isinstance(pending, list) and len(pending) == 2 and all(
            isinstance(v, int) and v >= 0 for v in pending
        )):  # fmt: skip
            raise ValueError("the shardscale.verl state's 'pending' must be two ints >= 0")
        self.scaler.load_state_dict(state["scaler"])  # validates before it changes anything
        for name in _COUNTERS:
            setattr(self, name, state[name])
        self.pending = list(pending)


def engine_state(engine: Any) -> ShardscaleEngineState:
    """The state ``use_shardscale`` keeps for ``engine``; raises if it was not applied."""
    state = engine.__dict__.get(_STATE)
    if not isinstance(state, ShardscaleEngineState):
        raise RuntimeError("use_shardscale(engine) was not applied to this engine")
    return state


def is_using_shardscale(engine: Any) -> bool:
    """Whether :func:`use_shardscale` was applied to ``engine``."""
    return isinstance(getattr(engine, "__dict__", {}).get(_STATE), ShardscaleEngineState)


# -- the replaced methods (bound to one engine with types.MethodType) ---------------------------


def scaled_step(
    state: ShardscaleEngineState, optimizer: torch.optim.Optimizer, clip: float
) -> float:
    """``unscale_and_clip_``, ``scaler.step``, ``scaler.update`` and one host read; the norm.

    Records the scale this step's loss was multiplied by and whether the step
    was skipped (on every rank) in ``state``. Shared by the engine and the legacy actor.
    """
    scaler = state.scaler
    scale = scaler.scale_tensor  # the scale this step's loss was multiplied by (no host read)
    used = scale.detach().clone() if scale is not None else None
    norm = unscale_and_clip_(scaler, optimizer, max_norm=clip)
    scaler.step(optimizer)
    scaler.update()
    flag = scaler.last_step_skipped
    parts = [norm.detach().reshape(()).to(torch.float64)]
    if used is not None:
        parts.append(used.reshape(()).to(norm.device, torch.float64))
    if flag is not None:
        parts.append(flag.reshape(()).to(norm.device, torch.float64))
    values = torch.stack(parts).tolist()  # one host read: verl reads the norm with .item() too
    skipped = bool(values[-1]) if flag is not None else False
    state.last_loss_scale = values[1] if used is not None else 1.0
    state.last_skipped = skipped
    state.optimizer_steps += 1
    state.skipped_steps += int(skipped)
    state.pending[0] += 1
    state.pending[1] += int(not skipped)
    state.log.append((state.last_loss_scale, skipped))
    grad_norm: float = values[0]
    return grad_norm


def _optimizer_step(self: Any) -> float:
    return scaled_step(engine_state(self), self.optimizer, float(self.optimizer_config.clip_grad))


def _train_batch(self: Any, data: Any, loss_function: Any) -> Any:
    state = engine_state(self)
    state.last_skipped = None
    state.log.clear()
    outputs = type(self).train_batch(self, data, loss_function)
    if state.last_skipped is not None and self.is_mp_src_rank_with_outputs():
        metrics = outputs["metrics"]
        metrics["loss_scale"] = state.last_loss_scale
        metrics["step_skipped"] = float(state.last_skipped)
    return outputs


def _lr_scheduler_step(self: Any) -> Any:
    state = engine_state(self)
    steps, taken = state.pending
    state.pending = [0, 0]
    if steps > 0 and taken == 0:
        state.held_scheduler_steps += 1
        return self.lr_scheduler.get_last_lr()[0]  # what verl's returns, without advancing
    return type(self).lr_scheduler_step(self)


def _state_file(local_path: str) -> str:
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return os.path.join(local_path, _FILE.format(world=world, rank=rank))


def _save_checkpoint(
    self: Any,
    local_path: str | None,
    hdfs_path: str | None = None,
    global_step: int = 0,
    max_ckpt_to_keep: int | None = None,
    **kwargs: Any,
) -> None:
    type(self).save_checkpoint(self, local_path, hdfs_path, global_step, max_ckpt_to_keep, **kwargs)
    save_state(engine_state(self), local_path)


def save_state(state: ShardscaleEngineState, local_path: str | None) -> None:
    """Write ``state`` to this rank's file in ``local_path`` (after verl wrote its own)."""
    if local_path is None:
        return  # verl saves nothing either
    torch.save(state.state_dict(), _state_file(local_path))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank's file is there before any rank goes on


def load_state(state: ShardscaleEngineState, local_path: str | None) -> None:
    """Read this rank's file in ``local_path`` into ``state`` (before verl loads the rest)."""
    if local_path is None:
        return
    path = _state_file(local_path)
    if os.path.exists(path):
        # Ours first (before verl may delete local copies); a bad file raises here,
        # before anything changed.
        state.load_state_dict(torch.load(path, weights_only=True))
    else:
        warnings.warn(
            f"{path} is missing (a checkpoint saved without use_shardscale, or with another "
            "world size): the loss scale and skip counters keep their current values",
            stacklevel=3,
        )


def _load_checkpoint(
    self: Any,
    local_path: str | None,
    hdfs_path: str | None = None,
    del_local_after_load: bool = True,
    **kwargs: Any,
) -> None:
    load_state(engine_state(self), local_path)
    type(self).load_checkpoint(self, local_path, hdfs_path, del_local_after_load, **kwargs)


#: The engine methods use_shardscale replaces, and with what: a constant table (read-only).
_REPLACED: Mapping[str, Callable[..., Any]] = MappingProxyType(
    {
        "optimizer_step": _optimizer_step,
        "train_batch": _train_batch,
        "lr_scheduler_step": _lr_scheduler_step,
        "save_checkpoint": _save_checkpoint,
        "load_checkpoint": _load_checkpoint,
    }
)


def _device_name() -> str:
    from verl.utils.device import get_device_name

    name: str = get_device_name()
    return name


def check_scaler_arguments(
    scaler: ShardedGradScaler | None, scaler_options: Mapping[str, Any]
) -> None:
    """Refuse a scaler that is not shardscale's, or a scaler together with options."""
    if scaler is not None and not isinstance(scaler, ShardedGradScaler):
        raise TypeError(
            f"use_shardscale(scaler=...) takes a shardscale.core.ShardedGradScaler, got "
            f"{type(scaler).__name__}; pass its arguments as keywords instead."
        )
    if scaler is not None and scaler_options:
        raise ValueError(
            f"pass either a scaler or scaler options, not both (got {sorted(scaler_options)})"
        )


def prepare_scaler(
    owner: str,
    verl_scaler: Any,
    scaler: ShardedGradScaler | None,
    scaler_options: Mapping[str, Any],
) -> ShardedGradScaler:
    """The scaler that replaces ``verl_scaler`` (verl's own, or None outside fp16); checks it."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler

    if verl_scaler is not None and not isinstance(verl_scaler, TorchScaler):
        raise RuntimeError(
            f"{owner}.scaler is a {type(verl_scaler).__name__}, not verl's own torch "
            "ShardedGradScaler: something else already replaced it; use_shardscale would "
            f"drop it. Apply use_shardscale to a freshly built {owner}."
        )
    fp16 = verl_scaler is not None  # verl creates its scaler exactly when param_dtype is fp16
    if scaler is None:
        options: dict[str, Any] = dict(scaler_options)
        options.setdefault("loss_scaling", fp16)
        if options["loss_scaling"]:
            options.setdefault("growth_interval", 400)  # verl's own choice for its scaler
        options.setdefault("device", _device_name())
        scaler = ShardedGradScaler(**options)
    if not scaler.is_enabled():
        raise ValueError(
            "use_shardscale got a disabled scaler (enabled=False), which would drop verl's own "
            f"non-finite check; leave the {owner} as verl built it instead."
        )
    return scaler


def use_shardscale(
    engine: Any,
    *,
    scaler: ShardedGradScaler | None = None,
    checkpoint_manager: Any | None = None,
    **scaler_options: Any,
) -> ShardedGradScaler:
    """Make one verl FSDP engine (verl 0.9) or legacy actor (verl 0.7) scale, clip and skip.

    Call it once, right after ``engine.initialize()``::

        engine = FSDPEngineWithLMHead(model_config, engine_config, optim_config, ckpt_config)
        engine.initialize()
        use_shardscale(engine)               # the one added line

    In fp16 (``mixed_precision.param_dtype: fp16``, where verl creates torch's
    ``ShardedGradScaler``) the loss is scaled; in bf16 or fp32 the scaler is a
    non-finite guard (``loss_scaling=False``: no scaling, the step skipped on
    every rank when any rank's gradients are not finite). See the module
    docstring for exactly what changes, and docs/verl.md.

    On verl 0.7 it takes the legacy actor instead, right after it is built
    (see ``shardscale.verl._legacy`` and docs/verl.md)::

        actor = DataParallelPPOActor(actor_config, actor_module, actor_optimizer)
        use_shardscale(actor, checkpoint_manager=checkpoint_manager)   # the one added line

    Args:
        engine: an initialized ``verl.workers.engine.fsdp.transformer_impl.FSDPEngine``
            (``FSDPEngineWithLMHead``, ``FSDPEngineWithValueHead``) on verl 0.9, or a
            ``verl.workers.actor.dp_actor.DataParallelPPOActor`` with an optimizer on verl 0.7.
        scaler: a ready :class:`~shardscale.core.ShardedGradScaler`; else one is
            built from ``scaler_options``.
        checkpoint_manager: legacy actor only: the ``FSDPCheckpointManager`` that saves
            the actor's optimizer; its checkpoints then carry the scaler's state.
        **scaler_options: :class:`~shardscale.core.ShardedGradScaler`'s keyword
            arguments. Defaults: verl's device, ``loss_scaling`` True in fp16
            (then verl's ``growth_interval=400``), else False.

    Returns:
        The engine's scaler (also ``engine.scaler``).

    Raises:
        VerlContractError: the installed verl is not a supported release, changed what
            this relies on, or does not support ``engine``'s kind.
        TypeError: ``engine`` is neither an engine nor a legacy actor, or ``scaler`` not ours.
        RuntimeError: the engine is not initialized, or was given a scaler of another kind.
        ValueError: both ``scaler`` and options, a disabled scaler, or QAT.
    """
    if target_kind(engine) == "actor":
        from shardscale.verl._legacy import use_shardscale_on_actor

        return use_shardscale_on_actor(
            engine, scaler=scaler, checkpoint_manager=checkpoint_manager, **scaler_options
        )
    if checkpoint_manager is not None:
        raise TypeError(
            "checkpoint_manager is for verl 0.7's legacy actor; the FSDP engine saves the "
            "scaler's state in its own save_checkpoint: leave it out."
        )
    check_scaler_arguments(scaler, scaler_options)
    if is_using_shardscale(engine):
        if scaler is not None or scaler_options:
            raise RuntimeError(
                "use_shardscale was already applied to this engine; its scaler is "
                "engine.scaler (pass options the first time only)."
            )
        return engine_state(engine).scaler
    if not isinstance(getattr(engine, "optimizer", None), torch.optim.Optimizer):
        raise RuntimeError(
            "use_shardscale(engine) needs an initialized engine with an optimizer: call it "
            "right after engine.initialize() (a forward-only engine has nothing to scale)."
        )
    check_verl(engine)
    if getattr(engine, "_qat_enabled", False):
        raise ValueError(
            "use_shardscale does not support verl's QAT (its optimizer step also resets "
            "quantization scales); train without QAT or without use_shardscale."
        )
    scaler = prepare_scaler("engine", engine.scaler, scaler, scaler_options)
    engine.scaler = scaler
    engine.__dict__[_STATE] = ShardscaleEngineState(scaler)
    # Instance attributes shadow the class's methods for this engine only.
    for name, function in _REPLACED.items():
        setattr(engine, name, types.MethodType(function, engine))
    return scaler
