"""Learning-rate schedules computed on the device from a counter of taken steps.

[Note: a schedule that never syncs]
``DeviceLRSchedule`` keeps one int64 counter on the device. Each ``step()``
adds ``1 - skipped`` to it (tensor arithmetic on the skip flag, see
[Note: the skip signal]), evaluates the schedule's closed form at the counter
and copies the result into each param group's ``lr``, a float32 tensor on the
group's device. Nothing is read on the host, so a training loop whose
optimizer consumes ``lr`` on the device (fused Adam/AdamW/SGD, capturable
Adam/AdamW) never waits for the GPU, and skipped steps do not advance the
schedule.

The closed forms are torch's: after N steps of which K were skipped, the
learning rate equals that of the matching ``torch.optim.lr_scheduler`` class
stepped N - K times (``ConstantSchedule``: ConstantLR, ``LinearSchedule``:
LinearLR, ``CosineSchedule``: CosineAnnealingLR, ``StepSchedule``: StepLR,
``ExponentialSchedule``: ExponentialLR, ``WarmupSchedule``: SequentialLR of a
LinearLR warm-up and the schedule it wraps), up to rounding: torch updates
most of these recursively in float64 on the host; here they are evaluated in
float64 on the device and stored in float32, the dtype fused optimizer kernels
read ``lr`` in.

Why float32 and on the params' device: torch's fused CUDA kernels read a
tensor ``lr`` as ``float`` on the params' device; a CPU ``lr`` tensor would be
read with ``item()`` there, a sync per step.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
from typing import Any

import torch

from shardscale.schedules._skip_signal import SkipFlagReader, SkipSource

__all__ = [
    "ConstantSchedule",
    "CosineSchedule",
    "DeviceLRSchedule",
    "ExponentialSchedule",
    "LRSchedule",
    "LinearSchedule",
    "StepSchedule",
    "WarmupSchedule",
]


def _positive_int(value: object, name: str, owner: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}({name}=...) takes an int >= 1, got {value!r}")
    return value


def _factor(value: object, name: str, owner: str, *, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}({name}=...) takes a number, got {type(value).__name__}")
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{owner}({name}={value!r}) must lie in [{low}, {high}]")
    return float(value)


class LRSchedule(abc.ABC):
    """A learning-rate schedule with a closed form that ``DeviceLRSchedule`` evaluates on the device."""

    @abc.abstractmethod
    def lrs(self, taken: torch.Tensor, base_lrs: torch.Tensor) -> torch.Tensor:
        """The learning rates after ``taken`` steps (0-dim int64), one per entry of ``base_lrs``.

        Pure tensor arithmetic in ``base_lrs``'s dtype on its device: no host read.
        """


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConstantSchedule(LRSchedule):
    """``base_lr * factor`` for the first ``steps`` taken steps, then ``base_lr`` (torch's ConstantLR).

    ``ConstantSchedule()`` is a plain constant learning rate.
    """

    factor: float = 1.0
    steps: int = 0

    def __post_init__(self) -> None:
        _factor(self.factor, "factor", "ConstantSchedule", low=0.0, high=1.0)
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"ConstantSchedule(steps=...) takes an int >= 0, got {self.steps!r}")

    def lrs(self, taken: torch.Tensor, base_lrs: torch.Tensor) -> torch.Tensor:
        done = (taken >= self.steps).to(base_lrs.dtype)
        return base_lrs * (self.factor + (1.0 - self.factor) * done)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearSchedule(LRSchedule):
    """From ``start_factor * base_lr`` to ``end_factor * base_lr`` over ``steps``, then held (LinearLR).

    A linear warm-up is ``LinearSchedule(start_factor=0.01, steps=W)``.
    """

    start_factor: float
    end_factor: float = 1.0
    steps: int

    def __post_init__(self) -> None:
        _factor(self.start_factor, "start_factor", "LinearSchedule", low=0.0, high=1.0)
        _factor(self.end_factor, "end_factor", "LinearSchedule", low=0.0, high=1.0)
        _positive_int(self.steps, "steps", "LinearSchedule")

    def lrs(self, taken: torch.Tensor, base_lrs: torch.Tensor) -> torch.Tensor:
        t = taken.clamp(max=self.steps).to(base_lrs.dtype)
        slope = self.end_factor - self.start_factor
        return base_lrs * (self.start_factor + slope * t / self.steps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CosineSchedule(LRSchedule):
    """Half a cosine from ``base_lr`` down to ``min_lr`` over ``steps`` (CosineAnnealingLR).

    As in torch, the curve keeps going past ``steps`` (it rises again): set
    ``steps`` to the length of the run.
    """

    steps: int
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        _positive_int(self.steps, "steps", "CosineSchedule")
        _factor(self.min_lr, "min_lr", "CosineSchedule", low=0.0, high=math.inf)

    def lrs(self, taken: torch.Tensor, base_lrs: torch.Tensor) -> torch.Tensor:
        angle = math.pi * taken.to(base_lrs.dtype) / self.steps
        return self.min_lr + (base_lrs - self.min_lr) * (1 + torch.cos(angle)) / 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSchedule(LRSchedule):
    """``base_lr * gamma ** (taken // step_size)`` (StepLR)."""

    step_size: int
    gamma: float = 0.1

    def __post_init__(self) -> None:
        _positive_int(self.step_size, "step_size", "StepSchedule")
        _factor(self.gamma, "gamma", "StepSchedule", low=0.0, high=math.inf)

    def lrs(self, taken: torch.Tensor, base_lrs: torch.Tensor) -> torch.Tensor:
        periods = torch.div(taken, self.step_size, rounding_mode="floor").to(base_lrs.dtype)
        return base_lrs * torch.pow(self.gamma, periods)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExponentialSchedule(LRSchedule):
    """``base_lr * gamma ** taken`` (ExponentialLR)."""

    gamma: float

    def __post_init__(self) -> None:
        _factor(self.gamma, "gamma", "ExponentialSchedule", low=0.0, high=math.inf)

    def lrs(self, taken: torch.Tensor, base_lrs: torch.Tensor) -> torch.Tensor:
        return base_lrs * torch.pow(self.gamma, taken.to(base_lrs.dtype))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmupSchedule(LRSchedule):
    """A linear warm-up over ``steps`` from ``start_factor * base_lr``, then ``then`` from its start.

    torch's equivalent: ``SequentialLR([LinearLR(start_factor, 1.0, steps), then],
    milestones=[steps])``. ``start_factor=0`` (which LinearLR refuses) starts at 0.
    """

    steps: int
    start_factor: float = 0.0
    then: LRSchedule = dataclasses.field(default_factory=ConstantSchedule)

    def __post_init__(self) -> None:
        _positive_int(self.steps, "steps", "WarmupSchedule")
        _factor(self.start_factor, "start_factor", "WarmupSchedule", low=0.0, high=1.0)
        if not isinstance(self.then, LRSchedule):
            raise TypeError(
                f"WarmupSchedule(then=...) takes a schedule such as CosineSchedule(steps=...), "
                f"got {type(self.then).__name__}"
            )

    @functools.cached_property
    def _warm(self) -> LinearSchedule:
        return LinearSchedule(start_factor=self.start_factor, steps=self.steps)

    def lrs(self, taken: torch.Tensor, base_lrs: torch.Tensor) -> torch.Tensor:
        after = self.then.lrs((taken - self.steps).clamp(min=0), base_lrs)
        return torch.where(taken < self.steps, self._warm.lrs(taken, base_lrs), after)


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers that cannot take a tensor ``lr`` without reading it on the host."""
    if isinstance(optimizer, torch.optim.Adam):  # AdamW too: it subclasses Adam
        fix = "create it with fused=True (or capturable=True on a GPU)"
        ok = [bool(g.get("fused")) or bool(g.get("capturable")) for g in optimizer.param_groups]
    elif isinstance(optimizer, torch.optim.SGD):
        fix = "create it with fused=True"
        ok = [bool(g.get("fused")) for g in optimizer.param_groups]
    else:
        raise TypeError(
            f"DeviceLRSchedule writes a tensor lr, which only torch's Adam, AdamW and SGD can "
            f"consume on the device; {type(optimizer).__name__} is none of them. Use "
            "SkipAwareScheduler around a torch scheduler instead."
        )
    if not all(ok):
        raise ValueError(
            f"DeviceLRSchedule needs {type(optimizer).__name__} to read its tensor lr on the "
            f"device, but param group(s) {[i for i, v in enumerate(ok) if not v]} would read it on "
            f"the host every step (or refuse it: foreach Adam); {fix}, or use SkipAwareScheduler "
            "around a torch scheduler."
        )


def _usable_lr(lr: object, device: torch.device) -> bool:
    return (
        isinstance(lr, torch.Tensor)
        and lr.dtype is torch.float32
        and lr.device == device
        and lr.numel() == 1
        and not lr.requires_grad
    )


def _group_device(group: dict[str, Any]) -> torch.device:
    params = group["params"]
    if not params:
        raise ValueError("DeviceLRSchedule: a param group has no parameters")
    device: torch.device = params[0].device
    return device


class DeviceLRSchedule:
    """A learning-rate schedule on the device that holds still on skipped steps, without a sync.

    Replaces each param group's ``lr`` with a float32 tensor on the group's
    device and rewrites it after every ``step()`` from a device counter of
    *taken* steps (see [Note: a schedule that never syncs] in the source). The
    base learning rate of a group is its ``initial_lr`` if a torch scheduler set
    one, else its ``lr``.

    Typical use, after ``scaler.update()`` each iteration::

        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        sched = DeviceLRSchedule(
            opt, WarmupSchedule(steps=100, then=CosineSchedule(steps=900)), scaler=scaler
        )
        ...
        scaler.step(opt)
        scaler.update()
        sched.step()

    Args:
        optimizer: a torch Adam/AdamW (``fused=True`` or ``capturable=True``) or
            SGD (``fused=True``): the optimizers whose step reads a tensor ``lr``
            on the device. Anything else raises: use :class:`SkipAwareScheduler`.
        schedule: the closed form to follow (``ConstantSchedule``, ...).
        scaler: where the skip flag comes from (its public ``last_step_skipped``).
            Without it, pass ``skipped=`` to every :meth:`step`.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        schedule: LRSchedule,
        *,
        scaler: SkipSource | None = None,
    ) -> None:
        if not isinstance(schedule, LRSchedule):
            raise TypeError(
                f"DeviceLRSchedule(schedule=...) takes a schedule such as "
                f"CosineSchedule(steps=...), got {type(schedule).__name__}"
            )
        _check_optimizer(optimizer)
        devices = [_group_device(g) for g in optimizer.param_groups]
        self._reader = SkipFlagReader(scaler, who="DeviceLRSchedule.step")
        base: list[float] = []
        for group in optimizer.param_groups:
            initial = group.get("initial_lr", group["lr"])
            # One host read per group at setup, never per step.
            base.append(float(initial) if not isinstance(initial, float) else initial)
        if not all(math.isfinite(b) and b >= 0 for b in base):
            raise ValueError(
                f"DeviceLRSchedule: base learning rates must be finite and >= 0: {base}"
            )
        self.optimizer = optimizer
        self.schedule = schedule
        self._device = devices[0]
        # float64 where the device has it (MPS does not): the closed forms lose nothing.
        dtype = torch.float32 if self._device.type == "mps" else torch.float64
        self._base = torch.tensor(base, dtype=dtype, device=self._device)
        self._taken = torch.zeros((), dtype=torch.int64, device=self._device)
        self._lrs: list[torch.Tensor] = []
        for group, device, b in zip(optimizer.param_groups, devices, base, strict=True):
            group.setdefault("initial_lr", b)
            lr = group["lr"]
            if not _usable_lr(lr, device):  # a user's own float32 lr tensor is kept (aliases hold)
                lr = torch.tensor(b, dtype=torch.float32, device=device)
            self._lrs.append(lr)
        self._write()

    @property
    def taken_steps(self) -> torch.Tensor:
        """How many steps were taken (not skipped): a 0-dim int64 device tensor. Read-only."""
        return self._taken

    def get_last_lr(self) -> list[torch.Tensor]:
        """The current learning rates, one 0-dim float32 device tensor per group (copies)."""
        return [lr.clone() for lr in self._lrs]

    @torch.no_grad()
    def step(self, *, skipped: torch.Tensor | None = None) -> None:
        """Advance by one taken step unless the step just finished was skipped; no host read.

        Call it after ``scaler.update()``. ``skipped`` overrides the scaler's flag.
        """
        flag = self._reader.read(skipped)
        if flag is None:
            self._taken += 1
        else:
            self._taken += (~flag).to(self._device, torch.int64, non_blocking=True)
        self._write()

    def _write(self) -> None:
        groups = self.optimizer.param_groups
        if len(groups) != len(self._lrs):
            raise RuntimeError(
                f"DeviceLRSchedule was made for {len(self._lrs)} param groups, the optimizer now "
                f"has {len(groups)}; create the schedule after the last add_param_group()"
            )
        values = self.schedule.lrs(self._taken, self._base)
        for i, (group, lr) in enumerate(zip(groups, self._lrs, strict=True)):
            lr.copy_(values[i], non_blocking=True)
            # optimizer.load_state_dict() builds new group dicts: put the schedule's lr back
            # (an identity check on the host, no device read), as torch's schedulers rewrite it.
            if group["lr"] is not lr:
                group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        """``{"taken_steps": int, "base_lrs": [float, ...]}`` (one host read: checkpoint time)."""
        return {"taken_steps": int(self._taken.item()), "base_lrs": self._base.tolist()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; checked whole before anything changes."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"taken_steps", "base_lrs"}:
            raise ValueError(
                "DeviceLRSchedule.load_state_dict takes the dict state_dict() returned, with "
                f"keys taken_steps and base_lrs; got {state_dict!r:.200}"
            )
        taken, base = state_dict["taken_steps"], state_dict["base_lrs"]
        if isinstance(taken, bool) or not isinstance(taken, int) or taken < 0:
            raise ValueError(f"taken_steps must be an int >= 0, got {taken!r}")
        if not isinstance(base, list) or len(base) != len(self._lrs):
            raise ValueError(
                f"base_lrs must list one learning rate per param group ({len(self._lrs)}), "
                f"got {base!r}"
            )
        if not all(isinstance(b, (int, float)) and math.isfinite(b) and b >= 0 for b in base):
            raise ValueError(f"base_lrs must be finite numbers >= 0, got {base!r}")
        self._taken.fill_(taken)
        self._base.copy_(torch.tensor(base, dtype=self._base.dtype))
        self._write()
