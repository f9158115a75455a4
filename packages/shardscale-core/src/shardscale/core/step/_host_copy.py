"""A few device values copied to host memory without making the host wait.

Used for what the host learns one step late: the step's error blocks
(``_step_errors.ErrorBlocks``) and the streak of skipped steps
(``_verdict.SkipStreak``). Off the GPU the copy is done at once; on a GPU it
goes into pinned memory asynchronously, with an event that says when it landed.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HostCopy"]


class HostCopy:
    """The values of a device tensor, on their way to (or in) host memory."""

    __slots__ = ("_event", "_host", "_values")

    def __init__(self, values: torch.Tensor) -> None:
        self._event: Any = None
        self._values: list[Any] | None = None  # read once
        if values.device.type == "cpu":
            # Already host memory, and never written after the step: read in place (at 10^5
            # ranks a copy of the error blocks would cost more than the rest of the decision).
            # A 0-dim value stays one (a reshape would be one more op per step).
            self._host = values if values.dim() <= 1 else values.reshape(-1)
            return
        on_gpu = values.device.type == "cuda"
        self._host = torch.empty(values.numel(), dtype=values.dtype, pin_memory=on_gpu)
        self._host.copy_(values.reshape(-1), non_blocking=on_gpu)
        if on_gpu:
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()

    @property
    def on_device(self) -> bool:
        """Whether the copy is asynchronous (an accelerator's values)."""
        return self._event is not None

    def arrived(self) -> bool:
        """Whether the copy is done (always, off the GPU)."""
        return self._event is None or bool(self._event.query())

    def read(self, *, wait: bool = True) -> list[Any] | None:
        """The values as Python numbers; None if not ``wait`` and the copy is still on its way."""
        if self._values is not None:
            return self._values
        if self._event is not None:
            if not wait and not self._event.query():
                return None
            self._event.synchronize()
        # tolist, not item: on the CPU it reads the memory without a _local_scalar_dense,
        # which the host-read tests rightly count as a device read.
        values = self._host.tolist()
        self._values = values if isinstance(values, list) else [values]
        return self._values
