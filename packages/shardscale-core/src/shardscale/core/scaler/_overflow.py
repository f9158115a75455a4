"""Overflow localisation: after a skipped step, which ranks and parameters held inf/nan.

[Note: localisation rides on the step's read]
The step's one all-reduce already carries, per rank, how many local
gradients were non-finite, so *which ranks* is known on every rank at no
cost. *Which parameters* is local knowledge: where the step read per-tensor
norms (``unscale_and_clip_``, the check before a fused optimizer) their
finiteness is kept as a small device tensor; where torch's unscale kernel ran
(``unscale_``) only an aggregate flag exists, so the gradients are looked at
again by ``step()`` when it skips (the host already knows then), before the
iteration lets go of them at ``update()``. Turning that into names and gathering them
from every rank costs a host read and one object all-gather, paid only when
someone asks (:meth:`ShardedGradScaler.overflow_report`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shardscale.core.step._verdict import SkipReason

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from shardscale.core.step._types import StepResult

__all__ = ["OverflowReport", "build_overflow_report"]

_Iteration = list[tuple["weakref.ref[torch.optim.Optimizer]", "StepResult"]]


@dataclass(frozen=True, slots=True)
class OverflowReport:
    """What held non-finite gradients in the scaler's last iteration, and why it was skipped.

    ``ranks`` are the ranks (of the scaler's process group) with at least one
    non-finite local gradient; ``params`` maps each such rank to the names of
    its parameters whose gradient was non-finite (``"?"``: a parameter that
    neither the module nor the optimizer names; a rank without names: its
    ``unscale_`` was not followed by ``step()``, so only the rank is known).
    ``reason`` is the
    iteration's verdict (``scaler.last_skip_reason`` read on the host;
    ``SkipReason.NONE`` for a step taken), ``None`` before the first
    ``update()``. A step skipped for a spike or its loss has no non-finite
    gradient: the reason is what tells.
    """

    step: int
    ranks: tuple[int, ...]
    params: dict[int, tuple[str, ...]] = field(default_factory=dict)
    reason: SkipReason | None = None

    @property
    def overflowed(self) -> bool:
        """Whether any rank held a non-finite gradient."""
        return bool(self.ranks)

    @property
    def skipped(self) -> bool:
        """Whether the step was skipped, for any reason (``False`` when unknown)."""
        return self.reason is not None and self.reason is not SkipReason.NONE

    def __str__(self) -> str:
        head = f"step {self.step}"
        if self.reason is SkipReason.NONE:
            head += " taken"
        elif self.reason is not None:
            head += f" skipped ({self.reason.name.lower()})"
        if not self.ranks:
            return f"{head}: no non-finite gradients"
        lines = [f"{head}: non-finite gradients on rank(s) {list(self.ranks)}"]
        for rank in self.ranks:
            names = self.params.get(rank, ())
            shown = ", ".join(names[:8]) + (
                f", ... ({len(names)} in all)" if len(names) > 8 else ""
            )
            lines.append(f"  rank {rank}: {shown or '(parameters unknown)'}")
        return "\n".join(lines)


def _names(module: torch.nn.Module | None) -> dict[int, str]:
    if module is None:
        return {}
    return {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}


def _position_names(optimizer: torch.optim.Optimizer | None) -> dict[int, str]:
    if optimizer is None:
        return {}
    out = {}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            out[id(p)] = f"param_groups[{g}][{i}] {tuple(p.shape)}"
    return out


def _local_findings(iteration: _Iteration, module: torch.nn.Module | None) -> list[str]:
    by_module = _names(module)
    found: list[str] = []
    for opt_ref, result in iteration:
        by_position = _position_names(opt_ref())
        finite = result.finite.cpu().tolist() if result.finite is not None else None
        for i, (param_id, tensor) in enumerate(result.owners):
            if finite is not None:
                bad = not finite[i]
            elif tensor is None:  # let go after its iteration: only the flags could tell
                continue
            else:
                bad = not bool(torch.isfinite(tensor).all())
            if bad:
                found.append(by_module.get(param_id) or by_position.get(param_id) or "?")
    return found


def build_overflow_report(
    iteration: _Iteration,
    *,
    module: torch.nn.Module | None,
    step: int,
    group: ProcessGroup | None,
    reason: torch.Tensor | None = None,
) -> OverflowReport:
    """Assemble the report of one iteration (a collective when distributed: see the note).

    ``reason`` is the iteration's ``last_skip_reason`` (identical on every rank:
    it comes from the step's one reduction), read here on the host.
    """
    ranks: set[int] = set()
    for _, result in iteration:
        ranks.update(result.nonfinite_ranks())
    local = _local_findings(iteration, module)
    import torch.distributed as dist

    gathered: list[Any] = [local]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
    params = {r: tuple(names) for r, names in enumerate(gathered) if names}
    # A rank the vector names but whose tensors were freed still appears, without names.
    all_ranks = tuple(sorted(ranks | set(params)))
    why = None if reason is None else SkipReason(int(reason))
    return OverflowReport(step=step, ranks=all_ranks, params=params, reason=why)
