"""Clipping the gradients of given parameters: the one call every clip front end makes.

``shardscale.clip.clip_grad_norm_`` (configured by its arguments) and
``ShardedGradScaler.clip_grad_norm_`` (configured by the scaler) differ only in
where their :class:`StepConfig` comes from; what a clip does with it, and what it
returns, lives here once.
"""

from __future__ import annotations

import warnings

import torch

from shardscale.core.step._contract import check_error_if_nonfinite, nonfinite_norm_error
from shardscale.core.step._engine import run_step
from shardscale.core.step._plan import StepPlans
from shardscale.core.step._types import Apply, StepConfig, StepRequest

__all__ = ["clip_parameters_", "norm_dtype"]


def norm_dtype(grads: list[torch.Tensor]) -> torch.dtype:
    """The dtype torch returns a gradient norm in: the promotion of the gradients' dtypes.

    torch stacks the per-tensor norms (which promotes) and FSDP1 reduces
    ``torch.promote_types`` over the local gradients; with no gradient both
    return the default dtype. The engine computes in float32/float64 (see
    docs/migration.md); only the returned value is cast.
    """
    dtype: torch.dtype | None = None
    for g in grads:
        dtype = g.dtype if dtype is None else torch.promote_types(dtype, g.dtype)
    return dtype if dtype is not None else torch.get_default_dtype()


def _warn_if_no_grads(params: list[torch.Tensor]) -> None:
    # FSDP1's clip_grad_norm_ warns in these words: a rank without gradients still joins the
    # reduction, and its result's dtype cannot follow gradients it does not have.
    if params and all(getattr(p, "grad", None) is None for p in params):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        warnings.warn(
            f"Called clip_grad_norm_() on rank {rank} with no gradients -- returning the total "
            f"norm in the default dtype {torch.get_default_dtype()} (this rank still joins the "
            "reduction: the value is the global norm of the other ranks' gradients)",
            stacklevel=4,  # the caller of the public clip_grad_norm_
        )


def clip_parameters_(
    params: list[torch.Tensor],
    config: StepConfig,
    *,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    plans: StepPlans | None = None,
) -> torch.Tensor:
    """Clip ``params``' (unscaled) gradients by their global norm; return it in torch's dtype.

    One read of every local gradient, ONE collective, one multiply by
    ``min(1, max_norm / (norm + 1e-6))``. ``max_norm`` and ``norm_type`` are
    checked by the step's contract (a bad value on one rank makes every rank
    raise); with ``error_if_nonfinite`` a non-finite norm raises on every rank
    before any gradient changes. Warns, as FSDP1 does, on a rank without
    gradients (it still joins the reduction). ``plans``: where the caller keeps
    the step plan of these parameters (None: a cold step).
    """
    nonfinite = (
        nonfinite_norm_error(norm_type) if check_error_if_nonfinite(error_if_nonfinite) else None
    )
    result = run_step(
        params,
        config,
        StepRequest(
            apply=Apply.MULTIPLY,
            norm_type=norm_type,
            max_norm=max_norm,
            nonfinite_error=nonfinite,
            plans=plans,
        ),
    )
    assert result.norm is not None
    _warn_if_no_grads(params)
    return result.norm.to(norm_dtype([p.grad for p in params if p.grad is not None]))
