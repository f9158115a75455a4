"""One scaler iteration across several optimizers: unscale each once, update once.

[Note: one update per iteration]
torch's contract for several optimizers is: unscale (or clip) each optimizer
at most once, ``scaler.step`` each, then ONE ``scaler.update()``; update resets
every optimizer's "already unscaled" record and may change the scale. Lightning
calls the plugin's ``optimizer_step`` once per ``opt.step()``, so updating
there (as Lightning's own plugins do) would, with two optimizers, unscale the
second one's gradients a second time when it was unscaled before the first
step (``self.clip_gradients`` on both, then both steps), unscale gradients
still carrying the old scale by the new one, and back the scale off once per
optimizer. So a step only *records* the optimizer, and the update runs when the
iteration is over:

* after a step, when no optimizer of the Trainer is still due: none is unscaled
  and unstepped, none holds gradients without having stepped (the usual case:
  one optimizer, or all of them stepped);
* otherwise at the latest when ``training_step`` returns, when a new backward
  begins (gradients from here on carry the scale of the next iteration), or
  when an optimizer that already stepped is stepped again.

Each optimizer's own skip flag is known at its step (torch's rule: an optimizer
steps unless its own gradients overflowed), so a scheduler asked between two
optimizers' steps gets that optimizer's answer, not the previous iteration's.
"""

from __future__ import annotations

from typing import Any

import torch

from shardscale.core import ShardedGradScaler, optimizer_params

__all__ = ["Iteration", "step_and_flag"]


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


class Iteration:
    """What happened since the scaler's last update (see [Note: one update per iteration])."""

    def __init__(self) -> None:
        self.unscaled: set[int] = set()
        self.clipped: set[int] = set()
        self.stepped: dict[int, torch.Tensor | None] = {}
        self.norms: list[torch.Tensor] = []

    def due(self, optimizers: list[torch.optim.Optimizer]) -> bool:
        """Whether one of ``optimizers`` has still to step before the update."""
        for opt in optimizers:
            if id(opt) in self.stepped:
                continue
            if id(opt) in self.unscaled:
                return True
            if any(p.grad is not None for p in optimizer_params(opt)):
                return True
        return False

    def norm(self) -> torch.Tensor | None:
        """The 2-norm over every optimizer clipped in this iteration (each clip's own norm)."""
        if not self.norms:
            return None
        if len(self.norms) == 1:
            return self.norms[0]
        wide = torch.stack([n.to(torch.float64) for n in self.norms])
        combined: torch.Tensor = torch.linalg.vector_norm(wide).to(self.norms[0].dtype)
        return combined

    def clear(self) -> None:
        self.unscaled.clear()
        self.clipped.clear()
        self.stepped.clear()
        self.norms.clear()
