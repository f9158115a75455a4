"""Refusing parameters that share one gradient tensor before a step reads or writes it.

[Note: aliased gradients]
When two parameters' ``.grad`` are the same memory (``b.grad = a.grad``, or one
parameter passed twice), torch's ``GradScaler.unscale_`` divides that memory by
the scale once per parameter, ``clip_grad_norm_`` counts it once per parameter
and then multiplies it by the clip coefficient once per parameter: the update
is scaled by ``1/scale²`` and ``coef²``, and the norm it reports is neither the
norm of the gradients it stepped on nor the one ``unscale_and_clip_`` would
report (which reads before it writes). No answer is right for every reader, so
the step engine refuses such parameters, on every rank, before anything
changes. ``get_total_norm`` takes gradients, not parameters, and writes
nothing: there a tensor given twice counts twice, as in torch (the norm of the
list as given). Gradients that are disjoint views of one buffer (DDP's
``gradient_as_bucket_view``, FSDP1's ``use_orig_params``) are not aliased:
only a shared first element is looked for, which costs one pointer per gradient.
"""

from __future__ import annotations

import torch

from shardscale.core._errors import ShardscaleError
from shardscale.core.step._buckets import GradBuckets

__all__ = ["AliasedGradientError", "check_no_aliased_grads"]

_DATA_PTR = torch.Tensor.data_ptr


class AliasedGradientError(ShardscaleError, ValueError):
    """Two parameters of one step share a gradient tensor (see [Note: aliased gradients])."""


def check_no_aliased_grads(buckets: GradBuckets) -> None:
    """Raise :class:`AliasedGradientError` if two local gradients start at the same element."""
    by_device: dict[torch.device, list[int]] = {}
    for (device, _), tensors in buckets.every.items():
        by_device.setdefault(device, []).extend(map(_DATA_PTR, tensors))
    if all(len(set(ptrs)) == len(ptrs) for ptrs in by_device.values()):
        return  # the common case: one set per device, C-level maps, no per-parameter Python
    by_device = {}
    for (device, _), tensors in buckets.every.items():
        # Empty shards may share an address and hold nothing.
        by_device.setdefault(device, []).extend(t.data_ptr() for t in tensors if t.numel())
    if all(len(set(ptrs)) == len(ptrs) for ptrs in by_device.values()):
        return
    seen: dict[tuple[torch.device, int], torch.Tensor] = {}
    for param, local in buckets.owner_pairs():
        if not local.numel():
            continue
        key = (local.device, local.data_ptr())
        first = seen.get(key)
        if first is not None:  # the same parameter twice lands here too
            raise AliasedGradientError(_message(first, param))
        seen[key] = param


def _message(first: torch.Tensor, second: torch.Tensor) -> str:
    what = (
        f"one parameter of shape {tuple(first.shape)} is passed twice"
        if first is second
        else f"two parameters (shapes {tuple(first.shape)} and {tuple(second.shape)}) share one "
        "gradient tensor"
    )
    return (
        f"{what}, so unscaling or clipping would apply to that gradient twice and the norm "
        "would count it twice (torch's GradScaler and clip_grad_norm_ do so silently). Give "
        "each parameter its own gradient (p.grad = g.clone()), tie weights by sharing one "
        "Parameter object, and pass each parameter once."
    )
