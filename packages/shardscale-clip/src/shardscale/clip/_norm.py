"""Drop-ins for ``torch.nn.utils.get_total_norm`` and ``clip_grad_norm_`` on sharded gradients."""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from shardscale.clip import _pipeline as pipe
from shardscale.clip._validate import check_max_norm, check_norm_type
from shardscale.core import CollectiveBackend, GradBuckets, Registry, get_registry

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["clip_grad_norm_", "get_total_norm"]

TensorOrTensors = torch.Tensor | Iterable[torch.Tensor]


def _as_list(items: TensorOrTensors, what: str) -> list[torch.Tensor]:
    if isinstance(items, torch.Tensor):
        return [items]
    is_generator = isinstance(items, types.GeneratorType)
    out = list(items)
    if is_generator and not out:
        warnings.warn(
            f"`{what}` is an empty generator, no gradient clipping will occur.", stacklevel=3
        )
    return out


def _nonfinite_error(norm_type: float) -> RuntimeError:
    return RuntimeError(
        f"the total norm of order {norm_type} of the gradients is non-finite (inf or nan), so "
        "it cannot be clipped. Find the layer producing inf/nan, use a GradScaler with "
        "unscale_and_clip_ to skip such steps, or pass error_if_nonfinite=False to clip anyway."
    )


def _global_norm(
    buckets: GradBuckets,
    norm_type: float,
    *,
    device: torch.device,
    backend: CollectiveBackend,
    group: ProcessGroup | None,
    registry: Registry,
    kernels: str | None,
) -> torch.Tensor:
    partial = pipe.local_partial(buckets.counted, norm_type, registry, kernels, device)
    reduced = pipe.reduce_partial(partial, norm_type, backend, group)
    norm = pipe.root(reduced.partial, norm_type)
    # A MAX reduction may have dropped a nan: the flag says the norm is not a number.
    return torch.where(
        reduced.nonfinite & torch.isfinite(norm), torch.full_like(norm, math.nan), norm
    )


def _device(buckets: GradBuckets, fallback: list[torch.Tensor]) -> torch.device:
    for device in buckets.devices():
        return device
    for t in fallback:
        return t.device
    return torch.device("cpu")


def _measure(
    items: list[torch.Tensor],
    norm_type: float,
    *,
    as_grads: bool,
    foreach: bool | None,
    process_group: ProcessGroup | None,
    backend: str | CollectiveBackend | None,
    distinct_dims: Iterable[str],
    kernels: str | None,
    registry: Registry | None,
) -> tuple[torch.Tensor, GradBuckets, Registry, str | None]:
    """The global norm of ``items`` (grads, or params whose grads count), and what computed it."""
    reg = registry if registry is not None else get_registry()
    be = reg.make_backend(backend)
    ctx = pipe.adapter_context(be, process_group, distinct_dims)
    name = pipe.kernels_name(foreach, kernels)
    buckets = pipe.collect(items, ctx, reg, be, as_grads=as_grads)
    norm = _global_norm(
        buckets,
        norm_type,
        device=_device(buckets, items),
        backend=be,
        group=process_group,
        registry=reg,
        kernels=name,
    )
    return norm, buckets, reg, name


def get_total_norm(
    tensors: TensorOrTensors,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    process_group: ProcessGroup | None = None,
    backend: str | CollectiveBackend | None = None,
    distinct_dims: Iterable[str] = (),
    kernels: str | None = None,
    registry: Registry | None = None,
) -> torch.Tensor:
    """The global p-norm of ``tensors`` (gradients), as if all were one vector on one rank.

    A drop-in for :func:`torch.nn.utils.get_total_norm` that understands every
    layout an installed adapter knows (DTensor shards and replicas, FSDP1 flat
    parameters, plain tensors): each rank sums ``|g|^p`` over the parts it counts,
    and ONE all-reduce over ``process_group`` gives the exact global value.

    Returns a plain 0-dim float32 tensor (never a DTensor) with the same value
    on every rank, on the device of the first gradient. Plain tensors are taken
    to be replicated over the group (DDP); pass ``distinct_dims=("*",)`` when
    each rank holds different ones. FSDP1 gradients are only recognised through
    their parameters: use :func:`clip_grad_norm_` for them.

    Args:
        tensors: a tensor or an iterable of tensors (the gradients).
        norm_type: any p > 0, or ``float('inf')``.
        error_if_nonfinite: raise if the total norm is inf or nan (costs a host sync).
        foreach: None picks the best kernels for the device, True the
            multi-tensor ``foreach`` kernels, False the per-tensor ``loop`` ones.
        process_group: the reduction group (default: the default group). It must
            contain every rank that holds part of these gradients.
        backend: collective backend spec (``"c10d"``, ``"counting+c10d"``) or
            object; default ``$SHARDSCALE_BACKEND`` or automatic.
        distinct_dims: mesh dimension names whose coordinates hold different
            tensors (pipeline stages); ``"*"`` for plain tensors.
        kernels: a stats-kernels name, overriding the automatic choice.
        registry: the plugin registry (default: the process-wide one).
    """
    p = check_norm_type(norm_type)
    items = _as_list(tensors, "tensors")
    with torch.no_grad():
        norm, _, _, _ = _measure(
            items,
            p,
            as_grads=True,
            foreach=foreach,
            process_group=process_group,
            backend=backend,
            distinct_dims=distinct_dims,
            kernels=kernels,
            registry=registry,
        )
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise _nonfinite_error(p)
    return norm


def clip_grad_norm_(
    parameters: TensorOrTensors,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    process_group: ProcessGroup | None = None,
    backend: str | CollectiveBackend | None = None,
    distinct_dims: Iterable[str] = (),
    kernels: str | None = None,
    registry: Registry | None = None,
) -> torch.Tensor:
    """Clip the global gradient norm of ``parameters`` in place; return that norm.

    A drop-in for :func:`torch.nn.utils.clip_grad_norm_` for sharded models:
    one read of the gradients each rank counts, ONE all-reduce, then every
    local gradient is multiplied once by ``min(1, max_norm / (norm + 1e-6))``.
    With ``max_norm=inf`` nothing is multiplied and only the norm is computed.

    Returns a plain 0-dim float32 tensor, identical on every rank. Arguments
    are those of :func:`get_total_norm` plus ``max_norm`` (a number > 0, or
    ``float('inf')``). With ``error_if_nonfinite`` a non-finite norm raises
    before any gradient changes.
    """
    limit = check_max_norm(max_norm)
    p = check_norm_type(norm_type)
    params = _as_list(parameters, "parameters")
    with torch.no_grad():
        norm, buckets, reg, name = _measure(
            params,
            p,
            as_grads=False,
            foreach=foreach,
            process_group=process_group,
            backend=backend,
            distinct_dims=distinct_dims,
            kernels=kernels,
            registry=registry,
        )
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise _nonfinite_error(p)
        if not math.isinf(limit):
            pipe.multiply_(buckets.every, pipe.clip_coefficient(norm, limit), reg, name)
    return norm
