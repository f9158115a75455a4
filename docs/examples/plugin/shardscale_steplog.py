"""shardscale-steplog: an example third-party plugin (see docs/writing-a-plugin.md).

It provides two things through shardscale's hooks:

* ``steplog``, a *middleware*: it wraps any collective backend
  (``steplog+c10d``) and remembers every reduction that passes through it;
* a *step observer*: after every ``scaler.update()`` it appends one line per
  step (scale, overflow, grad norm) to :data:`STEP_LOG`.

A distribution ships it with one entry point in its ``pyproject.toml``::

    [project.entry-points.shardscale]
    steplog = "shardscale_steplog"
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from shardscale.core import (
    CollectiveBackend,
    Handle,
    MiddlewareBase,
    ReduceOp,
    StepRecord,
    hookimpl,
)

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = ["STEP_LOG", "StepLogMiddleware", "shardscale_middlewares", "shardscale_on_step"]

#: One human-readable line per finished scaler step (an observer's output).
STEP_LOG: list[str] = []


class StepLogMiddleware(MiddlewareBase):
    """Records each reduction; MiddlewareBase forwards everything else to the wrapped backend."""

    name: ClassVar[str] = "steplog"

    def __init__(self, inner: CollectiveBackend) -> None:
        super().__init__(inner)
        self.calls: list[tuple[str, int]] = []  # (op, number of elements)

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp, group: ProcessGroup | None
    ) -> Handle:
        """Record, then let the inner backend reduce."""
        self.calls.append((str(op), tensor.numel()))
        return self.inner.all_reduce(tensor, op=op, group=group)


@hookimpl
def shardscale_middlewares() -> Sequence[type]:
    """Offer the ``steplog`` middleware by name."""
    return [StepLogMiddleware]


@hookimpl
def shardscale_on_step(record: StepRecord) -> None:
    """Log each finished step. ``.item()`` syncs with the device: fine for a log, not for speed."""
    norm = "-" if record.grad_norm is None else f"{record.grad_norm.item():.4g}"
    STEP_LOG.append(
        f"step {record.step}: scale={record.scale.item():g} "
        f"overflow={bool(record.found_inf.item())} skipped={bool(record.skipped.item())} "
        f"grad_norm={norm}"
    )
