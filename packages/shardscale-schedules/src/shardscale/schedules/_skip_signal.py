"""Where a consumer of the skip signal (schedule, EMA) gets the flag of the step it follows.

[Note: the skip signal]
A step's verdict is a 0-dim device tensor, identical on every rank because it
comes from the step's one reduction: ``ShardedGradScaler.last_step_skipped``
after ``update()``, or any flag a caller passes in (a bool tensor, or a
``found_inf``-style float where nonzero means skipped). Consumers read it only
through this module, with the scaler's public API, so they never depend on the
scaler's internals. A missing flag means "taken": a disabled scaler skips
nothing. An enabled scaler that has not published a flag yet, or publishes the
same one twice, means ``update()`` did not run between two consumer steps: the
consumer would count the wrong step, so that is an error, found by identity
and never by reading the flag's value.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["SkipFlagReader", "SkipSource"]


@runtime_checkable
class SkipSource(Protocol):
    """Anything that publishes the last step's skip flag, like ``ShardedGradScaler``."""

    @property
    def last_step_skipped(self) -> torch.Tensor | None:
        """0-dim bool tensor on the device, or ``None`` when there is none."""
        ...

    def is_enabled(self) -> bool:
        """Whether the source can skip steps at all."""
        ...


def _as_flag(skipped: object, who: str) -> torch.Tensor:
    if not isinstance(skipped, torch.Tensor):
        raise TypeError(
            f"{who}: skipped= takes the step's skip flag as a one-element tensor (e.g. "
            f"scaler.last_step_skipped), got {type(skipped).__name__}"
        )
    if skipped.numel() != 1:
        raise ValueError(
            f"{who}: skipped= must hold one element (the step's verdict), got shape "
            f"{tuple(skipped.shape)}"
        )
    flag = skipped.detach().reshape(())
    return flag if flag.dtype is torch.bool else flag != 0


class SkipFlagReader:
    """Reads the skip flag for one consumer, remembering the scaler flag it used last."""

    __slots__ = ("_previous", "scaler", "who")

    def __init__(self, scaler: SkipSource | None, *, who: str) -> None:
        if scaler is not None and not isinstance(scaler, SkipSource):
            raise TypeError(
                f"{who}: scaler= takes a ShardedGradScaler (anything with last_step_skipped and "
                f"is_enabled()), got {type(scaler).__name__}"
            )
        self.scaler = scaler
        self.who = who
        self._previous: torch.Tensor | None = None

    def read(self, skipped: torch.Tensor | None) -> torch.Tensor | None:
        """The 0-dim bool flag of the step just finished, or ``None`` for "taken".

        ``skipped`` (passed per call) wins over the scaler. Never reads a value.
        """
        if skipped is not None:
            return _as_flag(skipped, self.who)
        scaler = self.scaler
        if scaler is None:
            raise ValueError(
                f"{self.who}: no skip signal: pass scaler=... when creating it, or skipped=... "
                "(e.g. scaler.last_step_skipped) to step()"
            )
        if not scaler.is_enabled():
            return None  # a disabled scaler never skips
        flag = scaler.last_step_skipped
        if flag is None or flag is self._previous:
            raise RuntimeError(
                f"{self.who}: the scaler has published no new skip flag since the last step() "
                "of this object; call scaler.update() after scaler.step(optimizer) and before "
                "this step(), once per optimizer step"
            )
        self._previous = flag
        return _as_flag(flag, self.who)
