"""``ShardscaleFSDP``: the mixin that gives an RLinf FSDP worker shardscale's scaler and clipping.

RLinf's ``FSDPModelManager`` (the base of its ``FSDPActor``, ``EmbodiedFSDPActor``
and SFT/reward workers) builds its loss scaler in one method and uses it in
another, and subclasses override methods to change behaviour (RLinf's own
workers do). ``ShardscaleFSDP``, placed first in a worker's bases, overrides:

* ``build_grad_scaler(enabled, **kwargs)``: a :class:`shardscale.core.ShardedGradScaler`
  on RLinf's device (``Worker.torch_device_type``) instead of torch's, which
  RLinf creates without a device (so "cuda"). ``fsdp_config.grad_scaler.enabled``
  true scales the loss (``init_scale``/``growth_interval`` from the config);
  false gives the non-finite guard (``loss_scaling=False``: no scaling, the
  step skipped on every rank when any rank's gradients are not finite).
* ``optimizer_step()``: ``unscale_and_clip_`` with ``optim.clip_grad`` (one read
  of each gradient, one collective: the overflow and the true global norm
  agree on every rank), then ``scaler.step`` and ``scaler.update``. It returns
  what RLinf's returns, ``(grad_norm, lr_list)``, so RLinf's ``actor/grad_norm``
  is the true global norm. (RLinf 0.3.0's FSDP2 strategy reduces its norm over
  a data-parallel group that a 1-D ``["fsdp"]`` mesh does not have: each rank
  logs and clips with the norm of its own shard.)
* ``build_lr_scheduler``: RLinf's scheduler, inside a scheduler that holds it
  (``step()`` does not advance it) when every optimizer step since its previous
  ``step()`` was skipped. RLinf's ``FSDPActor.training_step`` steps the scheduler
  right after ``optimizer_step``, skipped or not; held, the schedule counts the
  steps that changed the policy. ``state_dict``/``load_state_dict`` are RLinf's
  scheduler's own, so RLinf's checkpoint is unchanged.
* ``save_checkpoint`` / ``load_checkpoint``: RLinf's, plus one small file per
  rank in the checkpoint directory (``shardscale_world_size_W_rank_R.pt``: the
  scaler's ``state_dict`` and the skip counters), read back before RLinf loads
  the rest. RLinf's own checkpoint has no scaler state.

:meth:`ShardscaleFSDP.shardscale_metrics` gives the last step's loss scale and
skip for a worker's metrics. Nothing in torch or in RLinf's classes is patched.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from shardscale.clip import unscale_and_clip_
from shardscale.core import ShardedGradScaler
from shardscale.rlinf._contract import check_rlinf

__all__ = ["METRIC_KEYS", "ShardscaleFSDP"]

#: The keys :meth:`ShardscaleFSDP.shardscale_metrics` returns (RLinf's metric naming).
METRIC_KEYS = ("actor/loss_scale", "actor/step_skipped")

_STATE = "_shardscale_rlinf"
_FILE = "shardscale_world_size_{world}_rank_{rank}.pt"
_COUNTERS = ("optimizer_steps", "skipped_steps", "held_scheduler_steps")


@dataclass
class _State:
    """The scaler and the counters ``ShardscaleFSDP`` keeps on one worker.

    ``scaler`` is None between ``build_lr_scheduler`` and ``build_grad_scaler``
    (RLinf's ``setup_model_and_optimizer`` calls them in that order).
    """

    scaler: ShardedGradScaler | None = None
    optimizer_steps: int = 0
    skipped_steps: int = 0
    held_scheduler_steps: int = 0
    last_loss_scale: float | None = None
    last_skipped: bool | None = None
    # Optimizer steps since the scheduler's last step, and how many of them were taken.
    pending: tuple[int, int] = (0, 0)

    def ready_scaler(self) -> ShardedGradScaler:
        if self.scaler is None:
            raise RuntimeError(
                "this worker has no shardscale scaler yet: ShardscaleFSDP builds it in "
                "build_grad_scaler, which RLinf calls from setup_model_and_optimizer()"
            )
        return self.scaler

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {name: getattr(self, name) for name in _COUNTERS}
        state["scaler"] = self.ready_scaler().state_dict()
        state["pending"] = list(self.pending)
        return state

    def load_state_dict(self, state: Any) -> None:
        """Load what :meth:`state_dict` wrote; a malformed state changes nothing."""
        if not isinstance(state, dict):
            raise TypeError(f"a shardscale.rlinf state is a dict, got {type(state).__name__}")
        missing = [k for k in (*_COUNTERS, "scaler", "pending") if k not in state]
        if missing:
            raise ValueError(f"the shardscale.rlinf state has no {missing}: not written by it")
        for name in _COUNTERS:
            value = state[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"the shardscale.rlinf state's {name!r} must be an int >= 0")
        pending = state["pending"]
        if not (
            isinstance(pending, list | tuple)
            and len(pending) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in pending)
        ):
            raise ValueError("the shardscale.rlinf state's 'pending' must be two ints >= 0")
        # The scaler validates before it changes anything.
        self.ready_scaler().load_state_dict(state["scaler"])
        for name in _COUNTERS:
            setattr(self, name, state[name])
        self.pending = (pending[0], pending[1])


def _state(worker: Any, *, create: bool = False) -> _State:
    state = worker.__dict__.get(_STATE)
    if not isinstance(state, _State):
        if not create:
            raise RuntimeError(
                "this worker was not set up by ShardscaleFSDP: call setup_model_and_optimizer() "
                "(RLinf's, which builds the scheduler and the scaler) first"
            )
        state = _State()
        worker.__dict__[_STATE] = state
    return state


class _HeldScheduler(LRScheduler):
    """RLinf's scheduler, held on a step whose optimizer steps since the last were all skipped.

    It wraps the scheduler RLinf built (it does not run ``LRScheduler.__init__``,
    which would step it once more): ``step`` advances it or holds it; the rest is
    the wrapped scheduler's, its ``state_dict`` included, so RLinf's checkpoint
    stores and restores the schedule as before.
    """

    def __init__(self, inner: LRScheduler, state: _State) -> None:
        self.inner = inner
        self.optimizer = inner.optimizer
        self._skips = state

    @property
    def last_epoch(self) -> int:
        """The wrapped scheduler's step count."""
        epoch: int = self.inner.last_epoch
        return epoch

    @last_epoch.setter
    def last_epoch(self, value: int) -> None:
        self.inner.last_epoch = value

    def step(self, epoch: int | None = None) -> None:
        """Advance the wrapped scheduler, unless every optimizer step since the last was skipped."""
        steps, taken = self._skips.pending
        self._skips.pending = (0, 0)
        if steps > 0 and taken == 0:
            self._skips.held_scheduler_steps += 1
            return
        if epoch is None:
            self.inner.step()
        else:
            self.inner.step(epoch)

    def get_last_lr(self) -> list[float | torch.Tensor]:
        """The wrapped scheduler's last learning rates."""
        return self.inner.get_last_lr()

    def get_lr(self) -> list[float | torch.Tensor]:
        """The wrapped scheduler's learning rates."""
        return self.inner.get_lr()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state (what RLinf's checkpoint saved before)."""
        state: dict[str, Any] = self.inner.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped scheduler's state."""
        self.inner.load_state_dict(state_dict)


def _device_type() -> str:
    from rlinf.scheduler import Worker

    device = Worker.torch_device_type
    if not isinstance(device, str):
        raise RuntimeError(
            "RLinf found no accelerator (Worker.torch_device_type is None): build the "
            "worker where RLinf runs it, inside a worker launched on an accelerator"
        )
    return device


def _state_file(path: str) -> str:
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return os.path.join(path, _FILE.format(world=world, rank=rank))


class ShardscaleFSDP:
    """Put first in the bases of an RLinf FSDP worker: shardscale scales, clips, skips and holds.

    Example::

        class Actor(ShardscaleFSDP, FSDPActor):
            pass

    The worker's config is RLinf's, unchanged: ``fsdp_config.grad_scaler``
    (``enabled``, ``init_scale``, ``growth_interval``), ``optim.clip_grad`` and the
    schedule (held on steps whose optimizer steps were all skipped; see the module
    docstring for every override). RLinf's critic warm-up (``optim.critic_warmup_steps`` with a value head),
    whose ``optimizer_step`` rebuilds the optimizer, is refused.
    """

    def build_grad_scaler(self, enabled: bool, **kwargs: Any) -> ShardedGradScaler:
        """shardscale's scaler on RLinf's device, from RLinf's ``grad_scaler`` config.

        Raises:
            RLinfContractError: the installed RLinf changed what this relies on.
            ValueError: critic warm-up is configured.
            TypeError: an option is not one of the scaler's.
            RuntimeError: RLinf found no accelerator.
        """
        check_rlinf(self)
        if int(getattr(self, "critic_warmup_steps", 0) or 0) > 0:
            raise ValueError(
                "ShardscaleFSDP does not support RLinf's critic warm-up "
                "(optim.critic_warmup_steps): its optimizer_step rebuilds the optimizer. "
                "Set critic_warmup_steps to 0, or train without ShardscaleFSDP."
            )
        options: dict[str, Any] = dict(kwargs)
        options.setdefault("device", _device_type())
        options.setdefault("loss_scaling", bool(enabled))
        if not options["loss_scaling"]:
            # RLinf passes its config's init_scale/growth_interval whatever `enabled` says.
            for name in ("init_scale", "growth_interval"):
                options.pop(name, None)
        scaler = ShardedGradScaler(**options)
        _state(self, create=True).scaler = scaler
        return scaler

    def build_lr_scheduler(self, *args: Any, **kwargs: Any) -> LRScheduler:
        """RLinf's scheduler, held on steps whose optimizer steps were all skipped."""
        inner = super().build_lr_scheduler(*args, **kwargs)  # type: ignore[misc]
        if not isinstance(inner, LRScheduler):
            return inner  # type: ignore[no-any-return]  # not a torch scheduler: left as built
        return _HeldScheduler(inner, _state(self, create=True))

    def optimizer_step(self) -> tuple[float, list[float]]:
        """Unscale and clip in one pass, step or skip on every rank together, update the scale.

        Returns:
            ``(grad_norm, lr_list)`` as RLinf's own: the true global norm of the
            unscaled gradients (inf or nan on a skipped step) and each param
            group's learning rate.
        """
        state = _state(self)
        scaler = state.ready_scaler()
        worker: Any = self
        worker.optimizer_steps += 1
        clip = float(worker._cfg.optim.clip_grad)
        scale = scaler.scale_tensor  # the scale this step's loss was multiplied by
        used = scale.detach().clone() if scale is not None else None
        norm = unscale_and_clip_(scaler, worker.optimizer, max_norm=clip)
        scaler.step(worker.optimizer)
        scaler.update()
        flag = scaler.last_step_skipped
        parts = [norm.detach().reshape(()).to(torch.float64)]
        if used is not None:
            parts.append(used.reshape(()).to(norm.device, torch.float64))
        if flag is not None:
            parts.append(flag.reshape(()).to(norm.device, torch.float64))
        values = torch.stack(parts).tolist()  # one host read: RLinf reads its norm with .item()
        skipped = bool(values[-1]) if flag is not None else False
        state.last_loss_scale = values[1] if used is not None else 1.0
        state.last_skipped = skipped
        state.optimizer_steps += 1
        state.skipped_steps += int(skipped)
        state.pending = (state.pending[0] + 1, state.pending[1] + int(not skipped))
        grad_norm: float = values[0]
        if skipped:
            logger = getattr(worker, "_logger", None)
            if logger is not None:
                logger.warning(
                    f"[shardscale] non-finite gradients (norm {grad_norm}): optimizer step "
                    f"skipped on every rank; loss scale now {scaler.get_scale()}"
                )
        lr_list = [group["lr"] for group in worker.optimizer.param_groups]
        return grad_norm, lr_list

    def shardscale_metrics(self) -> dict[str, float]:
        """The last optimizer step's loss scale and skip (1.0 skipped, 0.0 taken), RLinf-named."""
        state = _state(self)
        if state.last_skipped is None:
            return {}
        return {
            METRIC_KEYS[0]: float(state.last_loss_scale or 1.0),
            METRIC_KEYS[1]: float(state.last_skipped),
        }

    def save_checkpoint(self, save_path: str, step: int = 0) -> None:
        """RLinf's checkpoint, plus this rank's scaler state beside it."""
        super().save_checkpoint(save_path, step)  # type: ignore[misc]  # RLinf's, after us in the MRO
        os.makedirs(save_path, exist_ok=True)
        torch.save(_state(self).state_dict(), _state_file(save_path))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # every rank's file is there before any rank goes on

    def load_checkpoint(self, load_path: str) -> None:
        """This rank's scaler state (first: a bad file raises before anything changed), then RLinf's."""
        state = _state(self)
        path = _state_file(load_path)
        if os.path.exists(path):
            state.load_state_dict(torch.load(path, weights_only=True))
        else:
            warnings.warn(
                f"{path} is missing (a checkpoint saved without ShardscaleFSDP, or with another "
                "world size): the loss scale and skip counters keep their current values",
                stacklevel=2,
            )
        super().load_checkpoint(load_path)  # type: ignore[misc]  # RLinf's, after us in the MRO
