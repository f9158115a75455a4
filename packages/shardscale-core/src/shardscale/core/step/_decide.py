"""Stages 5 and 6, decide and apply: the verdict from the reduced vector, then the gradients' multiply."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardscale.core._protocols import Handle
from shardscale.core.step._arith import (
    global_norm,
    reason_into,
)
from shardscale.core.step._errors import (
    ErrorBlocks,
    add_pending,
)
from shardscale.core.step._verdict import SkipReason, Verdict

if TYPE_CHECKING:
    pass
from shardscale.core.step._reduce import status_of, wait_for
from shardscale.core.step._types import EPS, Apply, LocalStep, StepRequest, StepResult


@dataclass(slots=True, eq=False)
class PendingStep:
    """A step whose all-reduce is issued and whose decision is not made yet.

    :func:`~shardscale.core.step.run_step` completes it at once; a lazy
    request leaves it on the result, completed by :meth:`StepResult.wait`
    (so a middleware like ``coalescing`` can merge several reductions).
    """

    result: StepResult
    handle: Handle
    local: LocalStep
    request: StepRequest

    def complete(self) -> StepResult:
        """Wait for the all-reduce, decide, and raise here if any rank failed (unless deferred)."""
        wait_for(self.handle)
        decide(self.result, self.local, self.request)
        if not self.request.defer_errors:
            self.result.raise_errors(wait=False)
        return self.result


def decide(result: StepResult, local: LocalStep, request: StepRequest) -> None:
    """found_inf, norm, coef, grad_scale and the verdict from the reduced vector, identical on
    every rank, in a fixed handful of device ops (see [Note: the step's fixed cost] in
    ``_step_arith``)."""
    vec, layout = result.vector, result.layout
    p, max_norm, scale, verdict = local.norm_type, local.max_norm, request.scale, request.verdict
    assert result.skip is not None
    spike = verdict.spike if verdict is not None and p is not None else None
    # -1 matches no status: a rank that failed sets the flag itself (see Probe).
    own = -1.0 if local.error is not None else status_of(local, result.chain)
    scratch = local.scratch()
    found = scratch.probe(layout.world, own, _weights(verdict, spike=spike is not None), vec.device)
    # float64 when this rank reads float64 gradients, as torch; decided locally (no host read
    # of the vector), so ranks agree whenever they hold the same parameter dtypes.
    f64 = any(dtype is torch.float64 for _, dtype in local.buckets.every)
    value = None
    if p is not None:
        # In float64, written into a float32 output unless this rank reads float64 gradients.
        out = None if f64 else result._norm32
        value, blocks = global_norm(vec, layout, p, scale=scale, out=out)
        result.nonfinite_block = blocks[layout.PER_RANK.index("nonfinite")]
        if spike is not None:
            # Its flag is weighted in the reason: a spike skips unless a stronger reason does.
            spike.is_spike(value, out=found.spike)
    reason = reason_into(vec, found, out=result.skip_reason)
    result.skip_reason = reason
    result._errors = ErrorBlocks(vec, layout, reason, failed_at=int(SkipReason.ERROR))
    # A non-finite gradient, an error or a disagreement on any rank: nothing is stepped on.
    bad = reason >= int(SkipReason.NONFINITE)
    torch.ge(reason, int(SkipReason.NONFINITE), out=result.found_inf)
    if value is not None:
        # float32 constants: the result keeps the value's dtype.
        nan, inf = (scratch.constant(v, vec.device, torch.float32) for v in (math.nan, math.inf))
        result.norm = torch.where(bad, torch.where(found.nan, nan, inf), value)
        if not math.isinf(max_norm):
            # In float64 from the reported norm (float32 + float64 0-dim tensors: float64).
            clip = scratch.constant(max_norm, vec.device) / (
                result.norm + scratch.constant(EPS, vec.device)
            )
            # As torch's clip_grad_norm_, a nan norm gives a nan coefficient (minimum keeps it).
            if scale is None:
                torch.minimum(clip, scratch.constant(1.0, vec.device), out=result.coef)
            else:
                # With a scaler an overflow step is skipped: leave the grads as unscale_ would
                # (found_inf is 1 then; fmax takes it over a coefficient of 0 or nan).
                clip = torch.minimum(clip, scratch.constant(1.0, vec.device))
                torch.fmax(clip, result.found_inf, out=result.coef)
    if request.apply is Apply.FUSED:
        assert scale is not None
        coef = result.coef if result.coef.device == scale.device else result.coef.to(scale.device)
        result.grad_scale = scale / coef
    torch.gt(reason, 0, out=result.skip)
    if result._errors.on_device:
        add_pending(result)


def _weights(verdict: Verdict | None, *, spike: bool) -> tuple[tuple[str, int], ...]:
    """What each flag of the reduced vector weighs in the reason (see ``_step_arith.Probe``)."""
    kind = verdict.nonfinite_reason if verdict is not None else SkipReason.NONFINITE
    weights = [("nonfinite", int(kind)), ("status", int(SkipReason.ERROR))]
    if verdict is not None:  # a clip call alone does not skip for a loss it never saw
        weights.append(("loss_nonfinite", int(SkipReason.LOSS)))
    if spike:
        weights.append(("spike", int(SkipReason.SPIKE)))
    return tuple(weights)


def apply(
    local: LocalStep, result: StepResult, request: StepRequest, *, inv_scale: torch.Tensor | None
) -> None:
    if request.apply is not Apply.MULTIPLY:
        return
    if inv_scale is None and math.isinf(local.max_norm):
        return  # nothing to unscale, nothing to clip
    factor = result.coef if inv_scale is None else result.coef * inv_scale.to(result.coef.device)
    for (dev, _dtype), tensors in local.buckets.every.items():
        if tensors:
            local.kernels[dev].mul_(tensors, factor.to(dev, non_blocking=True))
