"""Keep any torch learning-rate scheduler from advancing on skipped steps, one step late on the host.

[Note: deciding on the host without waiting for the step]
A torch scheduler's ``step()`` is host Python: whether to call it needs the
skip flag's value on the host. Reading it inside ``step()`` would make the host
wait for the whole step just queued (optimizer included). Instead
``SkipAwareScheduler.step()`` starts an asynchronous copy of the flag into
pinned host memory (on a GPU; off it the copy is immediate) and *defers* the
decision. The deferred ``step()`` of the wrapped scheduler runs at the first of:

- the optimizer's next ``step()`` (a step pre-hook), i.e. just before the new
  learning rate is used: by then the next forward and backward are queued, so
  the host waits only for the flag of the step before while the device is busy;
- the next ``SkipAwareScheduler.step()`` (the optimizer step was skipped
  without calling the optimizer, as an unfused optimizer's scaler step does);
- any read of the scheduler through the wrapper (``get_last_lr()``,
  ``state_dict()``, ``last_epoch``, ...).

It is taken at once when the copy has already landed (always off a GPU). So
the learning rate every optimizer step sees is exactly the wrapped scheduler's
after N - K advances, and the host runs at most one step ahead of the device
(the usual depth of a training loop's queue). The only place the deferral
shows is ``optimizer.param_groups[i]["lr"]`` read directly between
``step()`` and the next optimizer step: it may still hold the previous value.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from shardscale.schedules._skip_signal import SkipFlagReader, SkipSource

__all__ = ["DeferredStep", "SkipAwareScheduler"]


class _HostFlag:
    """A 0-dim bool flag on its way to host memory: asynchronous and pinned on a GPU."""

    __slots__ = ("_event", "_host")

    def __init__(self, flag: torch.Tensor) -> None:
        on_gpu = flag.device.type == "cuda"
        self._host = torch.empty((), dtype=torch.bool, pin_memory=on_gpu)
        self._host.copy_(flag, non_blocking=on_gpu)
        self._event: Any = None
        if on_gpu:
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()

    def ready(self) -> bool:
        """Whether the value has landed (reading it now costs no wait)."""
        return self._event is None or bool(self._event.query())

    def value(self) -> bool:
        """The flag, waiting for its copy if needed (only for it, not for later work)."""
        if self._event is not None:
            self._event.synchronize()
        return bool(self._host.tolist())  # a host tensor: tolist() is no dispatcher read


class DeferredStep:
    """Runs a call unless the step it follows was skipped, deciding once the flag reaches the host.

    The deferral of :class:`SkipAwareScheduler`, for front ends that hold a
    scheduler in place (Lightning's precision plugin): :meth:`submit` takes the
    step's skip flag (a 0-dim device tensor) and the call's arguments, starts
    the flag's asynchronous copy to the host and returns; the call
    ``run(*args, **kwargs)`` happens, if the step was taken, at the first of
    the optimizer's next ``step()`` (a step pre-hook), the next
    :meth:`submit`, or :meth:`settle`. It happens at once when the copy has
    already landed (always off a GPU). See [Note: deciding on the host without
    waiting for the step]. Nothing here is a dispatcher read: the host reads
    its own pinned copy.

    Args:
        optimizer: the optimizer whose next step settles a pending decision.
        run: what to call on a taken step (the scheduler's own ``step``). Keep it
            free of strong references to whatever owns this object: the
            optimizer's hook holds this object only weakly.
    """

    __slots__ = ("__weakref__", "_hook", "_pending", "_run")

    def __init__(self, optimizer: torch.optim.Optimizer, run: Callable[..., Any]) -> None:
        self._run = run
        self._pending: tuple[_HostFlag, tuple[Any, ...], dict[str, Any]] | None = None
        ref = weakref.ref(self)

        def before_optimizer_step(*_: Any) -> None:
            me = ref()
            if me is not None:
                me.settle()

        self._hook = optimizer.register_step_pre_hook(before_optimizer_step)

    @property
    def pending(self) -> bool:
        """Whether a decision is still waiting for its flag."""
        return self._pending is not None

    def submit(self, flag: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Call ``run(*args, **kwargs)`` once ``flag`` (0-dim bool) is known to be false."""
        self.settle()
        self._pending = (_HostFlag(flag), args, kwargs)
        if self._pending[0].ready():
            self.settle()

    def settle(self) -> None:
        """Take a pending decision now, waiting for its flag if it has not landed yet."""
        pending, self._pending = self._pending, None
        if pending is not None:
            flag, args, kwargs = pending
            if not flag.value():
                self._run(*args, **kwargs)

    def drop(self) -> None:
        """Forget a pending decision (a loaded state replaces it)."""
        self._pending = None

    def remove(self) -> None:
        """Settle, then detach from the optimizer."""
        self.settle()
        self._hook.remove()


class SkipAwareScheduler:
    """Wraps a torch ``LRScheduler`` so that it does not advance on skipped steps.

    ``step()`` takes the step's skip flag (from ``scaler=``, or ``skipped=``)
    and calls the wrapped scheduler's ``step()`` only if the optimizer step was
    taken, so after N steps with K skipped it has advanced N - K times. The
    decision waits for the flag's value on the host, but never inside
    ``step()``: it is taken at the latest just before the optimizer's next
    step, when the device has the next forward and backward queued (see
    [Note: deciding on the host without waiting for the step] in the source).
    For a schedule with no host work at all, see :class:`DeviceLRSchedule`.

    Every other attribute (``get_last_lr``, ``state_dict``, ``last_epoch``,
    ``optimizer``, ...) is the wrapped scheduler's, read after any deferred
    step is settled.

    Args:
        scheduler: any ``torch.optim.lr_scheduler.LRScheduler``. Arguments given
            to :meth:`step` besides ``skipped`` are passed on to it
            (``ReduceLROnPlateau``'s metric).
        scaler: where the skip flag comes from (its public ``last_step_skipped``).
            Without it, pass ``skipped=`` to every :meth:`step`.
    """

    def __init__(self, scheduler: LRScheduler, *, scaler: SkipSource | None = None) -> None:
        if not isinstance(scheduler, LRScheduler):
            raise TypeError(
                f"SkipAwareScheduler wraps a torch.optim.lr_scheduler.LRScheduler, got "
                f"{type(scheduler).__name__}"
            )
        if isinstance(scheduler, SkipAwareScheduler):  # pragma: no cover - not an LRScheduler
            raise TypeError("this scheduler is already wrapped")
        self.scheduler = scheduler
        self._reader = SkipFlagReader(scaler, who="SkipAwareScheduler.step")
        self._deferred = DeferredStep(scheduler.optimizer, scheduler.step)

    def step(self, *args: Any, skipped: torch.Tensor | None = None, **kwargs: Any) -> None:
        """Advance the wrapped scheduler unless the step just finished was skipped.

        Call it after ``scaler.update()``, once per optimizer step. Never waits
        for the device; the decision may be deferred (see the class docs).
        """
        self.settle()
        flag = self._reader.read(skipped)
        if flag is None:
            self.scheduler.step(*args, **kwargs)
            return
        self._deferred.submit(flag, args, kwargs)

    def settle(self) -> None:
        """Take a deferred decision now, waiting for its flag if it has not landed yet."""
        self._deferred.settle()

    def get_last_lr(self) -> list[Any]:
        """The wrapped scheduler's last learning rates, after any deferred step."""
        self.settle()
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state, after any deferred step (checkpoints stay torch's)."""
        self.settle()
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped scheduler's state; a deferred step is dropped (the state replaces it)."""
        self._deferred.drop()
        self.scheduler.load_state_dict(state_dict)

    def remove(self) -> None:
        """Detach from the optimizer (settling first); the wrapped scheduler is left as it is."""
        self._deferred.remove()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("scheduler", "_deferred", "_reader"):
            raise AttributeError(name)
        self.settle()
        return getattr(self.scheduler, name)
