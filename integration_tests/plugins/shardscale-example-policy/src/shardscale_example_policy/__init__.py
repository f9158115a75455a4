"""A third-party shardscale skip policy in one module: skip a step whose loss is a spike.

``LossMedianSkip(k=3.0)`` skips a step when its loss exceeds ``k`` times the
median of the last ``window`` accepted losses. The step's loss is the mean,
over the ranks that observed one (``scaler.scale(loss)`` or
``scaler.observe_loss(loss)``), of each rank's loss: two SUM slots of the
step's one all-reduce (the losses and how many ranks hold one), so every rank
decides the same way without a collective or a host read of its own. The
window lives on the device and is fed after ``update()`` only with accepted
steps' losses; it is checkpointed with the scaler's ``state_dict()`` under
``policy.loss_median``.

Everything a policy author needs is here (see docs/skipped-steps.md, "Writing a
skip policy"): a frozen option class with ``name``, ``code``, ``precedence``
and ``slots``, ``fingerprint()`` and ``bind(device)``; a state class with
``fill``, ``flag``, ``after_update``, ``state_dict`` and ``load_state_dict``;
and a ``@hookimpl`` function exposed through ``[project.entry-points.shardscale]``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from shardscale.core import hookimpl

__all__ = ["LossMedianSkip", "shardscale_skip_policies"]

_F64 = torch.float64


@dataclass(frozen=True, slots=True, kw_only=True)
class LossMedianSkip:
    """Skip a step whose loss exceeds ``k`` x the median of the last ``window`` accepted losses.

    ``k`` in (1, 1000]; ``window`` in 1..4096 (the device memory and the median's
    cost are bounded by it); the test arms once ``warmup`` (1..window) losses
    have been accepted.
    """

    name: ClassVar[str] = "loss_median"
    code: ClassVar[int] = 16
    precedence: ClassVar[int] = 15  # above a gradient-norm spike (10), below a non-finite loss (20)
    slots: ClassVar[tuple[str, ...]] = ("loss_sum", "loss_ranks")

    k: float = 3.0
    window: int = 32
    warmup: int = 4

    def __post_init__(self) -> None:
        k = self.k
        if isinstance(k, bool) or not isinstance(k, numbers.Real) or not 1.0 < float(k) <= 1000.0:
            raise ValueError(f"LossMedianSkip(k={k!r}): must be a number in (1, 1000]")
        for name, value, high in (("window", self.window, 4096), ("warmup", self.warmup, None)):
            top = self.window if high is None else high
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise ValueError(f"LossMedianSkip({name}={value!r}): must be an int in 1..{top}")

    def fingerprint(self) -> str:
        """The options as text, compared across ranks."""
        return f"k={float(self.k)!r}, window={self.window}, warmup={self.warmup}"

    def bind(self, device: torch.device) -> LossMedianState:
        """New device state (the window) for one scaler."""
        return LossMedianState(self, device)


class LossMedianState:
    """The window of accepted losses on the device: row 0 of a (2 x window) ring, nan where empty.

    ``after_update`` writes the step's loss at row ``skipped or no rank held a
    loss``, column ``count % window``, and counts it in that row: row 1 is
    written and never read, so no branch and no host read decides whether the
    loss is kept.
    """

    def __init__(self, policy: LossMedianSkip, device: torch.device) -> None:
        self.policy = policy
        self.ring = torch.full((2, policy.window), math.nan, dtype=_F64, device=device)
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)
        self._one = torch.ones((), dtype=torch.int64, device=device)
        self._loss = torch.zeros((), dtype=_F64, device=device)  # the last step's global loss
        self._held = torch.zeros((), dtype=torch.bool, device=device)  # some rank held a loss

    def fill(self, out: Mapping[str, torch.Tensor], *, loss: torch.Tensor | None) -> None:
        """This rank's loss and whether it holds one (every slot written: the scratch is reused)."""
        if loss is None:
            out["loss_sum"].zero_()
            out["loss_ranks"].zero_()
        else:
            out["loss_sum"].copy_(loss)
            out["loss_ranks"].fill_(1.0)

    def flag(
        self,
        reduced: Mapping[str, torch.Tensor],
        *,
        norm: torch.Tensor | None,
        found_inf: torch.Tensor,
        loss: torch.Tensor | None,
    ) -> torch.Tensor:
        """Whether the ranks' mean loss exceeds k x the median of the window (armed after warmup)."""
        ranks = reduced["loss_ranks"]
        torch.gt(ranks, 0, out=self._held)
        torch.div(reduced["loss_sum"], ranks.clamp(min=1.0), out=self._loss)
        median = torch.nanmedian(self.ring[0])  # nan while empty: no comparison holds
        armed = self.counts[0] >= self.policy.warmup
        return (self._loss > median * float(self.policy.k)) & armed & self._held

    def after_update(self, reason: torch.Tensor) -> None:
        """Keep the step's loss if the step was taken (``reason`` 0) and some rank held one."""
        row = ((reason != 0) | ~self._held).to(torch.int64)
        at = self.counts[0].remainder(self.policy.window)
        self.ring.index_put_((row, at), self._loss)
        self.counts.index_put_((row,), self._one, accumulate=True)

    def state_dict(self) -> dict[str, Any]:
        """The accepted losses held, oldest first, and how many were accepted (a host read)."""
        count = int(self.counts[0].item())
        size = self.policy.window
        held = min(count, size)
        ring: list[float] = self.ring[0].tolist()
        return {"losses": [ring[(count - held + i) % size] for i in range(held)], "accepted": count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values; a bad one raises and changes nothing."""
        losses, count = state.get("losses"), state.get("accepted")
        if not isinstance(losses, (list, tuple)) or not all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
            for v in losses
        ):
            raise ValueError(
                f"policy.loss_median 'losses' must be a list of finite numbers, got {losses!r}"
            )
        if isinstance(count, bool) or not isinstance(count, int) or count < len(losses):
            raise ValueError(
                f"policy.loss_median 'accepted' must be an int >= {len(losses)}, got {count!r}"
            )
        size = self.policy.window
        kept = [float(v) for v in losses][-size:]
        ring = torch.full((2, size), math.nan, dtype=_F64)
        for i, value in enumerate(kept):
            ring[0, (count - len(kept) + i) % size] = value
        self.ring.copy_(ring)
        self.counts.copy_(torch.tensor([count, 0], dtype=torch.int64))


@hookimpl
def shardscale_skip_policies() -> Sequence[type]:
    """The ``loss_median`` skip policy."""
    return [LossMedianSkip]
