"""Keep a learning-rate scheduler from advancing on optimizer steps the scaler skipped.

[Note: holding a scheduler]
Lightning steps ``interval="step"`` schedulers after every optimizer step,
skipped or not, through the module's ``lr_scheduler_step`` hook, which a
precision plugin cannot see. The plugin therefore gives each such scheduler a
subclass of its own class (created once per class) whose ``step`` hands the
decision to :class:`~shardscale.schedules.DeferredStep`, the deferral of
``SkipAwareScheduler``: the skip flag of the scheduler's optimizer (for every
reason: overflow, non-finite gradient, loss, spike) is copied to the host
asynchronously, and the scheduler's own ``step`` runs, if the step was taken,
at the optimizer's next step at the latest -- never a read of a device value
inside ``step`` (none at all off a GPU, where the copy lands at once). The
scheduler's ``__dict__`` -- hence its ``state_dict`` -- is untouched and
``isinstance`` still holds; ``get_last_lr()`` and ``state_dict()`` settle a
pending decision first, ``load_state_dict()`` drops it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardscale.schedules import DeferredStep

__all__ = ["hold_on_skipped_steps", "is_held"]

SkipFlag = Callable[[torch.optim.Optimizer], "torch.Tensor | None"]


@dataclass(slots=True)
class _Hold:
    flag_of: SkipFlag
    deferred: DeferredStep


_HOLDS: weakref.WeakKeyDictionary[Any, _Hold] = weakref.WeakKeyDictionary()
_SUBCLASSES: dict[type, type] = {}


class _HoldOnSkip:
    """Mixin placed before the scheduler's own class: ``step`` waits for the skip verdict."""

    optimizer: torch.optim.Optimizer

    def step(self, *args: Any, **kwargs: Any) -> Any:
        hold = _HOLDS.get(self)
        if hold is None:
            return super().step(*args, **kwargs)  # type: ignore[misc]
        hold.deferred.settle()  # the previous step's decision first, in order
        flag = hold.flag_of(self.optimizer)
        if flag is None:
            return super().step(*args, **kwargs)  # type: ignore[misc]
        hold.deferred.submit(flag.detach().reshape(()).bool(), args, kwargs)
        return None

    def get_last_lr(self) -> Any:
        _settle(self)
        return super().get_last_lr()  # type: ignore[misc]

    def state_dict(self) -> Any:
        _settle(self)
        return super().state_dict()  # type: ignore[misc]

    def load_state_dict(self, state_dict: Any) -> Any:
        hold = _HOLDS.get(self)
        if hold is not None:
            hold.deferred.drop()  # the loaded state replaces what was pending
        return super().load_state_dict(state_dict)  # type: ignore[misc]


def _settle(scheduler: object) -> None:
    hold = _HOLDS.get(scheduler)
    if hold is not None:
        hold.deferred.settle()


def _own_step(scheduler: Any) -> Callable[..., Any]:
    """The scheduler's own ``step``, through a weak reference (the hold must not keep it alive)."""
    ref = weakref.ref(scheduler)

    def run(*args: Any, **kwargs: Any) -> Any:
        me = ref()
        return None if me is None else super(_HoldOnSkip, me).step(*args, **kwargs)  # type: ignore[misc]

    return run


def hold_on_skipped_steps(scheduler: Any, flag_of: SkipFlag) -> None:
    """Make ``scheduler.step()`` advance only when ``flag_of(scheduler.optimizer)`` is false.

    ``flag_of`` returns the optimizer's last skip flag (a 0-dim device tensor)
    or ``None`` ("taken"). The flag is never read inside ``step()``: see
    [Note: holding a scheduler]. Idempotent: a scheduler already held gets the
    new ``flag_of`` (a pending decision is taken first).
    """
    if not hasattr(scheduler, "optimizer") or not callable(getattr(scheduler, "step", None)):
        raise TypeError(
            f"expected a learning-rate scheduler with .optimizer and .step(), got "
            f"{type(scheduler).__name__}"
        )
    cls = type(scheduler)
    if not issubclass(cls, _HoldOnSkip):
        held = _SUBCLASSES.get(cls)
        if held is None:
            held = type(cls.__name__, (_HoldOnSkip, cls), {"__module__": cls.__module__})
            held.__qualname__ = cls.__qualname__
            _SUBCLASSES[cls] = held
        scheduler.__class__ = held
    hold = _HOLDS.get(scheduler)
    if hold is None:
        _HOLDS[scheduler] = _Hold(flag_of, DeferredStep(scheduler.optimizer, _own_step(scheduler)))
    else:
        hold.deferred.settle()
        hold.flag_of = flag_of


def is_held(scheduler: object) -> bool:
    """Whether :func:`hold_on_skipped_steps` was applied to ``scheduler``."""
    return isinstance(scheduler, _HoldOnSkip) and scheduler in _HOLDS
