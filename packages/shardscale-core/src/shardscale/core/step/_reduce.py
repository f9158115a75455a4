"""Stage 4, reduce: this rank's slots of the vector and the step's one all-reduce."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from shardscale.core._protocols import Handle, ReduceOp
from shardscale.core.step._arith import (
    TINY64,
    fill_local,
)
from shardscale.core.step._buckets import GradBuckets
from shardscale.core.step._errors import (
    chain_names,
    fingerprint,
    verify_same_chain,
)
from shardscale.core.step._vector import VectorLayout, pack_status

if TYPE_CHECKING:
    from shardscale.core.step._policy import BoundPolicies
from shardscale.core.step._read import Reading
from shardscale.core.step._types import LocalStep, StepConfig, StepRequest, StepResult


def result_device(
    scale: torch.Tensor | None,
    buckets: GradBuckets,
    items: Sequence[torch.Tensor],
    *,
    as_grads: bool,
) -> torch.device:
    if scale is not None:
        return scale.device
    for device in buckets.devices():
        if device.type != "meta":
            return device
    for item in items:
        grad = item if as_grads else getattr(item, "grad", None)
        if isinstance(grad, torch.Tensor) and grad.device.type != "meta":
            return grad.device
        if isinstance(item, torch.Tensor) and item.device.type != "meta":
            return item.device
    return torch.device("cpu")


def reduce(
    local: LocalStep,
    reading: Reading,
    config: StepConfig,
    request: StepRequest,
    *,
    device: torch.device,
) -> tuple[StepResult, Handle]:
    """Fill this rank's slots of the vector and issue the step's one all-reduce."""
    if config.verify_chain:
        verify_same_chain(config.backend, config.group, device)
    chain = chain_names(config.backend)
    policies = request.verdict.policies if request.verdict is not None else None
    vec, finite = _local_vector(
        reading,
        local,
        device=device,
        chain=chain,
        loss_nonfinite=request.loss_nonfinite,
        policies=policies,
        loss=request.loss,
    )
    handle = _issue(vec, config)
    found_inf, skip, coef, norm32 = local.scratch().fresh_outputs(device)
    result = StepResult(
        found_inf=found_inf,
        norm=None,
        coef=coef,
        grad_scale=None,
        device=device,
        vector=vec,
        world_size=local.world,
        rank=local.rank,
        local_error=local.error,
        chain=chain,
        group=config.group,
        declarations=local.declarations,
        finite=finite,
        # Filled by the decision; allocated now so that a lazy step's caller can hold them.
        skip=skip,
        skip_reason=torch.zeros((), dtype=torch.int64, device=device) if request.lazy else None,
        _norm32=norm32,
        policy_slots=policies.slots if policies is not None else (),
    )
    return result, handle


def _local_vector(
    reading: Reading,
    local: LocalStep,
    *,
    device: torch.device,
    chain: str,
    loss_nonfinite: torch.Tensor | None = None,
    policies: BoundPolicies | None = None,
    loss: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's slots of the step's vector, and which local tensors read finite.

    Few device ops, whatever the bucket count (see [Note: the step's fixed cost] in
    ``_step_arith``): slots the step has nothing for stay 0.
    """
    p = local.norm_type
    norm = bool(reading.counted_norms) and p is not None
    names: tuple[str, ...] = ("peak",) if norm else ()
    if norm and p is not None and not math.isinf(p):
        names += ("scaled_sum",)
    if reading.every_norms or reading.flags:
        names += ("nonfinite",)
    if reading.every_norms:
        names += ("nan",)
    if loss_nonfinite is not None:
        names += ("loss_nonfinite",)
    if policies is not None:
        names += policies.slots
    values = local.scratch().local_values(names, device)
    out = values.slots
    if norm and p is not None:
        n = _joined(reading.counted_norms).nan_to_num(0.0, 0.0, 0.0)  # finite ones only
        torch.amax(n, dim=0, out=out["peak"])
        if not math.isinf(p):
            # The floored peak is written: the decision divides by the largest (global_norm).
            peak = out["peak"].clamp_(min=TINY64)
            ratio = n / peak
            if p == 2.0:
                torch.dot(ratio, ratio, out=out["scaled_sum"])
            else:
                torch.sum(ratio.pow(p), dim=0, out=out["scaled_sum"])
    finite = None
    if reading.every_norms:
        every = _joined(reading.every_norms)
        finite = torch.isfinite(every)
        torch.sum(~finite, dim=0, dtype=torch.float64, out=out["nonfinite"])
        torch.sum(every.isnan(), dim=0, dtype=torch.float64, out=out["nan"])
    if reading.flags:  # the unscale kernel's found_inf, one per bucket
        flags = reading.flags
        if len(flags) == 1 and not reading.every_norms:
            torch.gt(flags[0], 0, out=out["nonfinite"])
        else:
            seen = torch.stack(flags).gt(0).sum()
            if reading.every_norms:
                out["nonfinite"].add_(seen)
            else:
                out["nonfinite"].copy_(seen)
    if loss_nonfinite is not None:
        observed = loss_nonfinite if loss_nonfinite.dim() == 0 else loss_nonfinite.reshape(())
        if observed.device != device:
            observed = observed.to(device, non_blocking=True)
        torch.ne(observed, 0, out=out["loss_nonfinite"])
    if policies is not None:
        policies.fill(out, loss=loss)
    floor = p is not None and not math.isinf(p)
    vec = fill_local(
        local.scratch(),
        VectorLayout(local.world, policies.slots if policies is not None else ()),
        local.rank,
        values,
        status=status_of(local, chain),
        peak_floor=floor,
    )
    return vec, finite


def status_of(local: LocalStep, chain: str) -> float:
    """This rank's packed ``status`` slot (see [Note: the reduced vector])."""
    return pack_status(local.code, fingerprint(chain), fingerprint(local.declarations))


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


_COLLECTIVE_NOTE = (
    "shardscale: this was the step's one all-reduce, which every rank of the reduction group "
    "joins once per scaler.unscale_/step or clip call; a rank that died, raised outside "
    "shardscale or skipped the call leaves the others failing here"
)


def _issue(vec: torch.Tensor, config: StepConfig) -> Handle:
    try:
        return config.backend.all_reduce(vec, op=ReduceOp.SUM, group=config.group)
    except Exception as exc:
        # A note, not a new exception: the backend's error type (and message) stays catchable.
        exc.add_note(_COLLECTIVE_NOTE)
        raise


def wait_for(handle: Handle) -> None:
    try:
        handle.wait()
    except Exception as exc:
        exc.add_note(_COLLECTIVE_NOTE)
        raise
