"""One scaler iteration across several prepared optimizers: unscale each once, update once.

[Note: one update per iteration]
torch's contract for several optimizers is: unscale (or clip) each optimizer
at most once, ``scaler.step`` each, then ONE ``scaler.update()``; update resets
every optimizer's "already unscaled" record and may change the scale.
Accelerate's ``AcceleratedOptimizer.step`` updates after every optimizer, so
with two optimizers and ``accelerator.clip_grad_norm_`` over all parameters
(which unscales both) the second optimizer's gradients were unscaled a second
time, gradients still carrying the old scale could be unscaled by the new one,
and one overflow backed the scale off once per optimizer. Here a step only
*records* the optimizer, and the update runs when the iteration is over:

* after a step, when no prepared optimizer is still due: none is unscaled and
  unstepped, none holds gradients without having stepped (the usual case: one
  optimizer, or all of them stepped);
* otherwise at the latest when ``accelerator.backward`` runs again (gradients
  from there on carry the next iteration's scale), or when an optimizer that
  already stepped is unscaled, clipped or stepped again.

Each optimizer's own skip flag is known at its step (torch's rule: an optimizer
steps unless its own gradients overflowed), so a scheduler stepped between two
optimizers' steps asks the right question.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer

from shardscale.core import ShardedGradScaler, optimizer_params

__all__ = ["Iteration", "inner", "step_and_flag"]


def step_and_flag(
    scaler: ShardedGradScaler, optimizer: torch.optim.Optimizer, **kwargs: Any
) -> tuple[Any, torch.Tensor | None]:
    """``scaler.step(optimizer)``, and whether THIS optimizer's step was skipped.

    The flag is a 0-dim bool tensor read without a host sync, or None where it
    cannot be known (an optimizer without step hooks, or a fused one on torch's
    retired ``grad_scaler=`` contract). An unfused optimizer skipped by the
    scaler never runs its ``step``; a fused one runs it and reads
    ``optimizer.found_inf``, which the scaler sets for it (torch's contract).
    """
    register = getattr(optimizer, "register_step_pre_hook", None)
    if register is None:
        return scaler.step(optimizer, **kwargs), None
    seen: list[torch.Tensor | None] = []

    def note(opt: Any, args: Any, kw: Any) -> None:
        found = getattr(opt, "found_inf", None)
        seen.append(None if found is None else found.reshape(-1)[0].gt(0))

    handle = register(note)
    try:
        out = scaler.step(optimizer, **kwargs)
    finally:
        handle.remove()
    if not seen:
        return out, torch.tensor(True)
    fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
    if seen[0] is None:
        return out, None if fused else torch.tensor(False)
    return out, seen[0]


def inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer an ``AcceleratedOptimizer`` wraps."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer  # type: ignore[no-any-return]


class Iteration:
    """What happened since the scaler's last update (see [Note: one update per iteration])."""

    def __init__(self, scaler: ShardedGradScaler, prepared: list[Any]) -> None:
        self.scaler = scaler
        self.prepared = prepared  # the Accelerator's own list: optimizers prepared later too
        self.unscaled: set[int] = set()
        self.stepped: dict[int, torch.Tensor | None] = {}

    def due(self) -> bool:
        """Whether a prepared optimizer has still to step before the update."""
        for opt in map(inner, self.prepared):
            if id(opt) in self.stepped:
                continue
            if id(opt) in self.unscaled:
                return True
            if any(p.grad is not None for p in optimizer_params(opt)):
                return True
        return False

    def end(self) -> None:
        """The scaler's one update for the optimizers stepped since the last."""
        stepped = bool(self.stepped)
        self.unscaled.clear()
        self.stepped.clear()
        if stepped:
            self.scaler.update()
