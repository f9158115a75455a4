"""One scaler iteration across several optimizers: unscale each once, update once.

For front ends that call the scaler on a user's behalf (the Lightning and
Accelerate integrations): :class:`Iteration` records what happened since the
scaler's last ``update()``, and :func:`step_and_flag` steps one optimizer and
tells whether THAT optimizer's step was skipped.

[Note: one update per iteration]
torch's contract for several optimizers is: unscale (or clip) each optimizer
at most once, ``scaler.step`` each, then ONE ``scaler.update()``; update resets
every optimizer's "already unscaled" record and may change the scale. A front
end that updates after every optimizer's step (as Lightning's own precision
plugins and Accelerate's ``AcceleratedOptimizer.step`` do) would, with two
optimizers both unscaled before the first step (a clip over all parameters),
unscale the second one's gradients a second time, unscale gradients still
carrying the old scale by the new one, and back the scale off once per
optimizer for one overflow. So a step only *records* the optimizer, and the
update runs when the iteration is over:

* after a step, when no optimizer of the front end is still :meth:`Iteration.due`:
  none is unscaled and unstepped, none holds gradients without having stepped
  (the usual case: one optimizer, or all of them stepped);
* otherwise at the latest when a new backward begins (gradients from there on
  carry the next iteration's scale), when the front end's training step
  returns, or when an optimizer that already stepped is unscaled, clipped or
  stepped again.

Each optimizer's own skip flag is known at its step (torch's rule: an
optimizer steps unless its own gradients overflowed), so a scheduler asked
between two optimizers' steps gets that optimizer's answer, not the previous
iteration's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardscale.core.scaler._scaler import ShardedGradScaler
from shardscale.core.step._buckets import optimizer_params

__all__ = ["Iteration", "step_and_flag"]


def step_and_flag(
    scaler: ShardedGradScaler, optimizer: torch.optim.Optimizer, **kwargs: Any
) -> tuple[Any, torch.Tensor | None]:
    """``scaler.step(optimizer)``, and whether THIS optimizer's step was skipped.

    Returns what ``scaler.step`` returns and the flag: a 0-dim bool tensor read
    without a host sync, or None where it cannot be known (an optimizer without
    step hooks, or a fused one on torch's retired ``grad_scaler=`` contract).
    An unfused optimizer skipped by the scaler never runs its ``step``; a fused
    one runs it and reads ``optimizer.found_inf``, which the scaler sets for it
    (torch's contract). A step pre-hook sees both.
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
        return out, torch.tensor(True)  # the scaler did not call step: skipped
    fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
    if seen[0] is None:
        return out, None if fused else torch.tensor(False)
    return out, seen[0]


class Iteration:
    """What happened to ``scaler``'s optimizers since its last update.

    See [Note: one update per iteration]. Optimizers are recorded by ``id``
    (the torch optimizer, not a framework's wrapper around it). The front end
    decides when the iteration ends and calls :meth:`end`.

    Attributes:
        scaler: the scaler whose iteration this is.
        unscaled: ids of the optimizers unscaled and not stepped yet.
        stepped: id of each optimizer stepped, with its own skip flag
            (see :func:`step_and_flag`).
    """

    def __init__(self, scaler: ShardedGradScaler) -> None:
        self.scaler = scaler
        self.unscaled: set[int] = set()
        self.stepped: dict[int, torch.Tensor | None] = {}

    def has_stepped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` stepped in this iteration (touching it again begins the next)."""
        return id(optimizer) in self.stepped

    def mark_unscaled(self, optimizer: torch.optim.Optimizer) -> None:
        """Record that ``optimizer`` was unscaled elsewhere (``unscale_and_clip_``).

        Nothing is recorded while the scaler is disabled: it unscales nothing.
        """
        if self.scaler.is_enabled():
            self.unscaled.add(id(optimizer))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """``scaler.unscale_(optimizer)`` unless already done in this iteration (torch allows one)."""
        if self.scaler.is_enabled() and id(optimizer) not in self.unscaled:
            self.scaler.unscale_(optimizer)
            self.unscaled.add(id(optimizer))

    def step(
        self, optimizer: torch.optim.Optimizer, **kwargs: Any
    ) -> tuple[Any, torch.Tensor | None]:
        """:func:`step_and_flag`, recorded; the update waits for :meth:`end`."""
        out, flag = step_and_flag(self.scaler, optimizer, **kwargs)
        self.stepped[id(optimizer)] = flag
        self.unscaled.discard(id(optimizer))
        return out, flag

    def due(self, optimizers: Iterable[torch.optim.Optimizer]) -> bool:
        """Whether one of ``optimizers`` has still to step before the update."""
        for opt in optimizers:
            if id(opt) in self.stepped:
                continue
            if id(opt) in self.unscaled:
                return True
            if any(p.grad is not None for p in optimizer_params(opt)):
                return True
        return False

    def end(self) -> dict[int, torch.Tensor | None]:
        """The scaler's one update for the optimizers stepped since the last; their flags.

        Clears the record; no update when nothing stepped (or the scaler is disabled).
        """
        stepped = dict(self.stepped)
        self.unscaled.clear()
        self.stepped.clear()
        if stepped and self.scaler.is_enabled():
            self.scaler.update()
        return stepped
