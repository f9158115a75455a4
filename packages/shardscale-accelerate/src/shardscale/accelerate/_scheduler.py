"""A prepared scheduler that holds on skipped steps without reading the skip flag on the host.

[Note: the prepared scheduler's deferred decision]
Accelerate's ``AcceleratedScheduler.step`` asks each of its optimizers
``step_was_skipped``, a Python bool: with shardscale's scaler that is a host
read of a device flag on every scheduler step (a sync after a fused step).
:class:`ShardscaleAcceleratedScheduler` keeps Accelerate's rules for when a
scheduler moves (not while accumulating gradients; every call when
``step_scheduler_with_optimizer=False``), but on a synchronised step it hands
the decision to :class:`~shardscale.schedules.DeferredStep`, the deferral of
``SkipAwareScheduler``: the combined skip flag of its optimizers (skipped if
any was, for any reason) is copied to the host asynchronously, and the wrapped
scheduler advances, if no optimizer skipped, as soon as the copy has landed,
at the latest at the optimizer's next step. Off a GPU the copy lands at once.
It then advances as Accelerate does on a taken step: once when batches are
split, else once per process (a scheduler with ``total_steps``, such as
``OneCycleLR``, not past its end). ``get_last_lr()``, ``get_lr()`` and
``state_dict()`` (``save_state``) settle a pending decision first;
``load_state_dict()`` drops it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import AcceleratorState

from shardscale.schedules import DeferredStep

__all__ = ["ShardscaleAcceleratedScheduler", "hold_prepared_scheduler"]

FlagOf = Callable[[Any], "torch.Tensor | bool | None"]


def _advance(ref: weakref.ref[ShardscaleAcceleratedScheduler]) -> Callable[..., None]:
    """The taken step's advance, run by the deferral (a weak reference: it must not keep it)."""

    def run(times: int, guard: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        me = ref()
        if me is None:
            return
        scheduler = me.scheduler
        for _ in range(times):
            # OneCycleLR and its kind refuse a step past total_steps; Accelerate stops there.
            past_end = hasattr(scheduler, "total_steps") and (
                scheduler._step_count > scheduler.total_steps
            )
            if guard and past_end:
                break
            scheduler.step(*args, **kwargs)

    return run


def _combined(flags: list[torch.Tensor]) -> torch.Tensor:
    """Skipped when any flag says so, as a 0-dim bool on the device of the step (no host read)."""
    device = next((f.device for f in flags if f.device.type != "cpu"), flags[0].device)
    combined = flags[0].reshape(()).to(device, torch.bool)
    for flag in flags[1:]:
        combined = combined | flag.reshape(()).to(device, torch.bool)
    return combined


class ShardscaleAcceleratedScheduler(AcceleratedScheduler):  # type: ignore[misc]
    """An ``AcceleratedScheduler`` whose hold on skipped steps never waits for the device.

    See [Note: the prepared scheduler's deferred decision]. Reading the wrapped
    scheduler directly (``sched.scheduler.last_epoch``) or the optimizer's
    ``param_groups`` between ``step()`` and the next optimizer step may, on a
    GPU, still show the previous value; ``get_last_lr()`` is always current.
    """

    _shardscale_deferred: DeferredStep
    _shardscale_flag_of: FlagOf

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Accelerate's step, the skip check deferred (see the module note)."""
        deferred = self.__dict__.get("_shardscale_deferred")
        if deferred is None:
            super().step(*args, **kwargs)
            return
        deferred.settle()  # the previous step's decision first, in order
        if not self.step_with_optimizer or not self.gradient_state.sync_gradients:
            super().step(*args, **kwargs)  # Accelerate's own: no skip flag is asked here
            return
        flags = [self._shardscale_flag_of(opt) for opt in self.optimizers]
        if any(isinstance(f, bool) for f in flags):
            super().step(*args, **kwargs)  # an optimizer not ours: Accelerate asks it
            return
        known = [f for f in flags if isinstance(f, torch.Tensor)]
        if not known:
            super().step(*args, **kwargs)  # no flag: nothing was skipped, nothing is read
            return
        split = bool(self.split_batches)
        times = 1 if split else AcceleratorState().num_processes
        deferred.submit(_combined(known), (times, not split, args, kwargs), {})

    def get_last_lr(self) -> Any:
        """The wrapped scheduler's last learning rates, after a pending decision."""
        self._shardscale_settle()
        return super().get_last_lr()

    def get_lr(self) -> Any:
        """The wrapped scheduler's ``get_lr()``, after a pending decision."""
        self._shardscale_settle()
        return super().get_lr()

    def state_dict(self) -> Any:
        """The wrapped scheduler's state, after a pending decision (checkpoints stay torch's)."""
        self._shardscale_settle()
        return super().state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        """Load the wrapped scheduler's state; a pending decision is dropped (the state replaces it)."""
        deferred = self.__dict__.get("_shardscale_deferred")
        if deferred is not None:
            deferred.drop()
        super().load_state_dict(state_dict)

    def _shardscale_settle(self) -> None:
        deferred = self.__dict__.get("_shardscale_deferred")
        if deferred is not None:
            deferred.settle()


def hold_prepared_scheduler(prepared: Any, flag_of: FlagOf) -> Any:
    """Give an ``AcceleratedScheduler`` the deferred hold; anything else is returned as it is.

    ``flag_of(optimizer)`` returns a prepared optimizer's last skip flag (a
    0-dim device tensor), ``None`` ("taken"), or a bool for an optimizer whose
    flag only Accelerate can ask (then Accelerate's own step runs).
    """
    optimizer = getattr(getattr(prepared, "scheduler", None), "optimizer", None)
    if type(prepared) is not AcceleratedScheduler or not isinstance(
        optimizer, torch.optim.Optimizer
    ):
        return prepared
    prepared.__class__ = ShardscaleAcceleratedScheduler
    prepared._shardscale_flag_of = flag_of
    prepared._shardscale_deferred = DeferredStep(optimizer, _advance(weakref.ref(prepared)))
    return prepared
