"""Drop-ins for ``torch.nn.utils.get_total_norm`` and ``clip_grad_norm_`` on sharded gradients.

Both are thin callers of the step engine (``shardscale.core.step.run_step``): one
read of every local gradient, ONE all-reduce, then (for ``clip_grad_norm_``)
one in-place multiply.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from shardscale.core import CollectiveBackend, Registry, get_registry
from shardscale.core.step import (
    Apply,
    StepConfig,
    StepRequest,
    check_distinct_dims,
    check_error_if_nonfinite,
    clip_parameters_,
    distinct_param_ids,
    eager,
    kernels_name,
    nonfinite_norm_error,
    norm_dtype,
    run_step,
)

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


def _config(
    *,
    foreach: bool | None,
    process_group: ProcessGroup | None,
    backend: str | CollectiveBackend | None,
    distinct_dims: Iterable[str],
    distinct_params: Iterable[torch.Tensor],
    kernels: str | None,
    registry: Registry | None,
) -> StepConfig:
    reg = registry if registry is not None else get_registry()
    return StepConfig(
        backend=reg.make_backend(backend),
        registry=reg,
        group=process_group,
        kernels=kernels_name(foreach, kernels),
        distinct_dims=check_distinct_dims(distinct_dims),
        distinct_params=distinct_param_ids(distinct_params),
    )


@eager
def get_total_norm(
    tensors: TensorOrTensors,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    process_group: ProcessGroup | None = None,
    backend: str | CollectiveBackend | None = None,
    distinct_dims: Iterable[str] = (),
    distinct_params: Iterable[torch.Tensor] = (),
    kernels: str | None = None,
    registry: Registry | None = None,
) -> torch.Tensor:
    """The global p-norm of ``tensors`` (gradients), as if all were one vector on one rank.

    A drop-in for :func:`torch.nn.utils.get_total_norm` that understands every
    layout an installed adapter knows (DTensor shards and replicas, FSDP1 flat
    parameters, plain tensors): each rank reads the parts it counts, and ONE
    all-reduce over ``process_group`` gives the exact global value.

    Returns a plain 0-dim tensor (never a DTensor) with the same value on every
    rank, on the device of the first gradient, in torch's dtype: the promotion
    of the gradients' dtypes (float16 for float16 gradients), or the default
    dtype when there are none. It is computed in float32 (float64 for float64
    gradients) and only then cast, so clipping uses the exact value even
    where a float16 result reads inf (above 65504; see docs/migration.md).
    Plain tensors are taken to be replicated over the group (DDP); pass
    ``distinct_dims=("*",)`` when each rank holds different ones. FSDP1
    gradients are only recognised through their parameters: use
    :func:`clip_grad_norm_` for them.

    Args:
        tensors: a tensor or an iterable of tensors (the gradients).
        norm_type: any p > 0, or ``float('inf')``.
        error_if_nonfinite: raise if the total norm is inf or nan (costs a host
            sync); every rank raises, since every rank sees the same norm.
        foreach: None picks the best kernels for the device, True the
            multi-tensor ``foreach`` kernels, False the per-tensor ``loop`` ones.
        process_group: the reduction group (default: the default group). It must
            contain every rank that holds part of these gradients.
        backend: collective backend spec (``"c10d"``, ``"counting+c10d"``) or
            object; default ``$SHARDSCALE_BACKEND`` or automatic.
        distinct_dims: mesh dimension names whose coordinates hold different
            tensors (pipeline stages); ``"*"`` for plain tensors.
        distinct_params: plain tensors among ``tensors`` that this rank holds
            its own of while the other plain ones are replicated (experts
            placed on this rank); each rank passes its own (docs/moe.md).
        kernels: a stats-kernels name, overriding the automatic choice.
        registry: the plugin registry (default: the process-wide one).
    """
    # max_norm/norm_type are checked by the step engine's contract (every rank raises together).
    nonfinite = (
        nonfinite_norm_error(norm_type) if check_error_if_nonfinite(error_if_nonfinite) else None
    )
    items = _as_list(tensors, "tensors")
    config = _config(
        foreach=foreach,
        process_group=process_group,
        backend=backend,
        distinct_dims=distinct_dims,
        distinct_params=distinct_params,
        kernels=kernels,
        registry=registry,
    )
    result = run_step(
        items,
        config,
        StepRequest(
            apply=Apply.NOTHING, norm_type=norm_type, as_grads=True, nonfinite_error=nonfinite
        ),
    )
    assert result.norm is not None
    return result.norm.to(norm_dtype(items))


@eager
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
    distinct_params: Iterable[torch.Tensor] = (),
    kernels: str | None = None,
    registry: Registry | None = None,
) -> torch.Tensor:
    """Clip the global gradient norm of ``parameters`` in place; return that norm.

    A drop-in for :func:`torch.nn.utils.clip_grad_norm_` for sharded models:
    one read of every local gradient, ONE all-reduce, then every local
    gradient is multiplied once by ``min(1, max_norm / (norm + 1e-6))``.
    With ``max_norm=inf`` nothing is multiplied and only the norm is computed.

    Returns a plain 0-dim tensor, identical on every rank (dtype as
    :func:`get_total_norm`). Arguments are those of :func:`get_total_norm`
    plus ``max_norm`` (a number > 0, or ``float('inf')``). With
    ``error_if_nonfinite`` a non-finite gradient on *any* rank, counted in
    the norm or not, makes every rank raise before any gradient changes.
    """
    params = _as_list(parameters, "parameters")
    config = _config(
        foreach=foreach,
        process_group=process_group,
        backend=backend,
        distinct_dims=distinct_dims,
        distinct_params=distinct_params,
        kernels=kernels,
        registry=registry,
    )
    return clip_parameters_(
        params,
        config,
        max_norm=max_norm,
        norm_type=norm_type,
        error_if_nonfinite=error_if_nonfinite,
    )
