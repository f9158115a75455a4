"""Keep a learning-rate scheduler from advancing on optimizer steps the scaler skipped.

[Note: holding a scheduler]
Lightning steps ``interval="step"`` schedulers after every optimizer step,
skipped or not, through the module's ``lr_scheduler_step`` hook, which a
precision plugin cannot see. The plugin therefore gives each such scheduler a
subclass of its own class (created once per class) whose ``step`` first asks
whether the scheduler's optimizer skipped its last step. The scheduler's
``__dict__`` -- hence its ``state_dict`` -- is untouched and ``isinstance``
still holds. The question is one host read of a 0-dim flag per scheduler
step: free after an unfused optimizer step (which read the flag already), one
small sync after a fused one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["hold_on_skipped_steps", "is_held"]

SkipFlag = Callable[[torch.optim.Optimizer], "torch.Tensor | None"]

_FLAGS: weakref.WeakKeyDictionary[Any, SkipFlag] = weakref.WeakKeyDictionary()
_SUBCLASSES: dict[type, type] = {}


class _HoldOnSkip:
    """Mixin placed before the scheduler's own class: ``step`` is a no-op after a skipped step."""

    optimizer: torch.optim.Optimizer

    def step(self, *args: Any, **kwargs: Any) -> Any:
        flag_of = _FLAGS.get(self)
        if flag_of is not None:
            flag = flag_of(self.optimizer)
            if flag is not None and bool(flag):
                return None
        return super().step(*args, **kwargs)  # type: ignore[misc]


def hold_on_skipped_steps(scheduler: Any, flag_of: SkipFlag) -> None:
    """Make ``scheduler.step()`` do nothing while ``flag_of(scheduler.optimizer)`` is true.

    Idempotent: a scheduler already held gets the new ``flag_of``.
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
    _FLAGS[scheduler] = flag_of


def is_held(scheduler: object) -> bool:
    """Whether :func:`hold_on_skipped_steps` was applied to ``scheduler``."""
    return isinstance(scheduler, _HoldOnSkip) and scheduler in _FLAGS
