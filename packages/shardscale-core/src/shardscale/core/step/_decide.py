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
from shardscale.core.step._policy import BUILTIN_PRECEDENCE
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
    policies = verdict.policies if verdict is not None else None
    weights = _weights(verdict, spike=spike is not None)
    found = scratch.probe(layout, own, weights, vec.device)
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
    if policies is None:
        # Only built-ins: the weights are SkipReason values, whose order is the precedence.
        reason = reason_into(vec, found, out=result.skip_reason)
        bad_from, ranked = int(SkipReason.NONFINITE), reason
    else:
        # The weights are precedences: the highest set flag's, then its code (one take).
        torch.ne(vec, found.expected, out=found.vector_flags)
        reduced = {name: vec[layout.shared(name)] for name in policies.slots}
        flags = policies.flags(
            reduced,
            norm=value,
            found_inf=found.vector_flags[layout.block("nonfinite")].any(),
            loss=request.loss,
        )
        for into, flag in zip(found.policy_flags, flags, strict=True):
            into.copy_(flag)
        ranked = torch.amax(found.flags * found.weights, dim=0)
        bad_from = BUILTIN_PRECEDENCE[SkipReason.NONFINITE]
        reason = torch.take(policies.codes, ranked)
        if result.skip_reason is not None:
            reason = result.skip_reason.copy_(reason)
    result.skip_reason = reason
    result._errors = ErrorBlocks(vec, layout, reason, failed_at=int(SkipReason.ERROR))
    # A non-finite gradient, an error or a disagreement on any rank: nothing is stepped on.
    bad = ranked >= bad_from
    torch.ge(ranked, bad_from, out=result.found_inf)
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
    """What each flag of the reduced vector weighs in the reason (see ``_step_arith.Probe``):
    the SkipReason itself when only built-ins are on, else its precedence (``_policy``)."""
    kind = verdict.nonfinite_reason if verdict is not None else SkipReason.NONFINITE
    reasons = [("nonfinite", kind), ("status", SkipReason.ERROR)]
    if verdict is not None:  # a clip call alone does not skip for a loss it never saw
        reasons.append(("loss_nonfinite", SkipReason.LOSS))
    if spike:
        reasons.append(("spike", SkipReason.SPIKE))
    if verdict is None or verdict.policies is None:
        return tuple((name, int(reason)) for name, reason in reasons)
    weights = [(name, BUILTIN_PRECEDENCE[reason]) for name, reason in reasons]
    weights += [
        (f"policy:{i}", policy.precedence) for i, policy in enumerate(verdict.policies.policies)
    ]
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
