"""Stage 3, read: each local gradient read once for its norm and non-finite flag."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    pass
from shardscale.core._protocols import overflow_safe
from shardscale.core.step._types import Apply, LocalStep, PrecomputedNorms, StepRequest


@dataclass(slots=True)
class Reading:
    counted_norms: list[torch.Tensor] = field(default_factory=list)  # 1-D per bucket, any value
    every_norms: list[torch.Tensor] = field(default_factory=list)  # 1-D per bucket, owners order
    flags: list[torch.Tensor] = field(default_factory=list)  # unscale kernel's found_inf
    #: 1/scale, for the unscale kernel and the multiply (the decision divides by the scale).
    inv_scale: torch.Tensor | None = None


def inverse_scale(request: StepRequest) -> torch.Tensor | None:
    if request.unscale_by is not None and request.apply is Apply.UNSCALE:
        return request.unscale_by.reshape(()).float()
    scale = request.scale
    return scale.double().reciprocal().float() if scale is not None else None


def read(
    local: LocalStep,
    request: StepRequest,
    *,
    device: torch.device,
) -> Reading:
    """Each local gradient read once: its norm and non-finite flag, or the unscale kernel."""
    inv_scale = inverse_scale(request) if request.apply in (Apply.UNSCALE, Apply.MULTIPLY) else None
    reading = Reading(inv_scale=inv_scale)
    if local.error is not None:
        return reading
    p = local.norm_type
    for (dev, dtype), tensors in local.buckets.every.items():
        if not tensors:
            continue
        kernels = local.kernels[dev]
        if request.apply is Apply.UNSCALE:
            assert inv_scale is not None
            flag = torch.zeros((), dtype=torch.float32, device=dev)
            kernels.unscale_and_check_(tensors, flag, inv_scale.to(dev, non_blocking=True))
            reading.flags.append(flag.to(device, non_blocking=True))
            continue
        counts = local.buckets.counts_mask[(dev, dtype)]
        norms = _bucket_norms(kernels, tensors, counts, p, request.precomputed, device)
        reading.every_norms.append(norms)
        if all(counts):
            reading.counted_norms.append(norms)
        elif any(counts):
            picked = (
                local.plan.counted_index((dev, dtype), device)
                if local.warm and local.plan is not None
                else torch.tensor([i for i, c in enumerate(counts) if c], device=device)
            )
            reading.counted_norms.append(norms[picked])
    return reading


def _bucket_norms(
    kernels: Any,
    tensors: Sequence[torch.Tensor],
    counts: Sequence[bool],
    p: float | None,
    precomputed: PrecomputedNorms | None,
    device: torch.device,
) -> torch.Tensor:
    """One float64 entry per tensor of a bucket: counted tensors' p-norm, the others' max|g|.

    Vectors, not per-tensor scalars: with thousands of small FSDP shards the Python
    bookkeeping per tensor would cost more than the read.
    """
    reuse = [precomputed.lookup(t) for t in tensors] if precomputed is not None else None
    if reuse is None and (p is None or all(counts) or not any(counts)):
        # One kernel call for the bucket, without a Python step per tensor.
        q = p if (p is not None and counts and counts[0]) else math.inf
        return tensor_norms(kernels, tensors, q).to(device=device, dtype=torch.float64)
    groups: dict[float, list[int]] = {}
    for i, c in enumerate(counts):
        if reuse is None or reuse[i] is None:
            groups.setdefault(p if (c and p is not None) else math.inf, []).append(i)
    if reuse is None and len(groups) == 1:  # the common case: one kernel call for the bucket
        ((q, _),) = groups.items()
        return tensor_norms(kernels, tensors, q).to(device=device, dtype=torch.float64)
    out = torch.empty(len(tensors), dtype=torch.float64, device=device)
    for q, idx in groups.items():
        got = tensor_norms(kernels, [tensors[i] for i in idx], q)
        out[torch.tensor(idx, device=device)] = got.to(device=device, dtype=torch.float64)
    if reuse is not None:
        seen = [i for i, r in enumerate(reuse) if r is not None]
        if seen:
            values = torch.stack([reuse[i].reshape(()).to(device, torch.float64) for i in seen])  # type: ignore[union-attr]
            out[torch.tensor(seen, device=device)] = values
    return out


def tensor_norms(kernels: Any, tensors: Sequence[torch.Tensor], p: float) -> torch.Tensor:
    """Per-tensor p-norms, 1-D, overflow-safe (see [Note: per-tensor norms without overflow])."""
    if overflow_safe(kernels):
        # The kernels normalise inside their one read (StatsKernels' optional attribute).
        safe: torch.Tensor = kernels.tensor_norms(tensors, p)
        return safe
    if p in (1.0, 2.0) or math.isinf(p):
        if p == 2.0 and tensors and tensors[0].dtype is torch.float64:  # one dtype per bucket
            if tensors[0].device.type == "cpu":
                return _float64_norms_on_cpu(kernels, tensors)
            return _normalised_norms(kernels, tensors, p)
        norms: torch.Tensor = kernels.tensor_norms(tensors, p)
        return norms
    return _normalised_norms(kernels, tensors, p)


def _float64_norms_on_cpu(kernels: Any, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """float64 2-norms in one read, normalising again only the tensors whose sum overflowed.

    A float64 sum of squares overflows only above a norm of ~1.3e154, so the plain read is
    almost always the answer; a non-finite one (an inf/nan element, or that overflow) is read
    again normalised. Deciding that reads the norms on the host, which costs nothing on the
    CPU; on an accelerator it would be a host sync, so there both reads are made.
    """
    norms: torch.Tensor = kernels.tensor_norms(tensors, 2.0)
    redo = [i for i, finite in enumerate(torch.isfinite(norms).tolist()) if not finite]
    if redo:
        again = _normalised_norms(kernels, [tensors[i] for i in redo], 2.0)
        norms[redo] = again.to(norms.dtype)
    return norms


def _normalised_norms(kernels: Any, tensors: Sequence[torch.Tensor], p: float) -> torch.Tensor:
    # a_t·‖g_t/a_t‖_p: every |element/a_t| ≤ 1, so no power can overflow (a second read).
    peaks: torch.Tensor = kernels.tensor_norms(tensors, math.inf)
    safe = torch.where((peaks > 0) & torch.isfinite(peaks), peaks, torch.ones_like(peaks))
    # Divide in the accumulation precision: a bf16 quotient would cost the norm 3 digits.
    scaled = [t.to(peaks.dtype) / s for t, s in zip(tensors, safe.unbind(), strict=True)]
    inner: torch.Tensor = kernels.tensor_norms(scaled, p)
    # Non-finite (or all-zero) tensors keep their peak, which already says so.
    ok = (peaks > 0) & torch.isfinite(peaks)
    return torch.where(ok, inner.to(peaks.dtype) * peaks, peaks)
