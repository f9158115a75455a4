"""``unscale_and_clip_``: the scaler's unscale and norm clipping in one read and one collective.

[Note: the fused step]
torch's recipe ``scaler.unscale_(opt); clip_grad_norm_(params, max_norm)`` makes
three passes over gradient memory (unscale R+W, norm R, clip R+W) and at least
two collectives (overflow flag, norm). Here the *still scaled* gradients are
read once: Σ|s·g|^p and a non-finite flag go through ONE all-reduce, then

* norm = (Σ|s·g|^p)^(1/p) / s, coef = min(1, max_norm / (norm + 1e-6));
* an ordinary optimizer gets every local gradient multiplied once by coef / s
  (one R+W pass) and steps on what torch's recipe would have given it;
* an optimizer with ``_step_supports_amp_scaling`` (fused Adam/AdamW/SGD)
  gets nothing multiplied: ``scaler.step()`` hands it grad_scale = s / coef
  and found_inf, and it divides inside its own kernel.

On overflow (any rank's flag) coef is forced to 1, so the gradients end as
torch's unscale_ leaves them, the optimizer skips the step, the scale backs
off in ``update()``, and the returned norm is inf or nan: never a silent nan
in the weights.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shardscale.clip import _pipeline as pipe
from shardscale.clip._norm import clip_grad_norm_
from shardscale.clip._streaming import StreamingStats
from shardscale.clip._validate import check_max_norm, check_norm_type
from shardscale.core import OptState, Registry, ShardedGradScaler, optimizer_params

__all__ = ["unscale_and_clip_"]


def _check_call(scaler: object, optimizer: object) -> None:
    if not isinstance(scaler, ShardedGradScaler):
        raise TypeError(
            f"unscale_and_clip_ needs a shardscale.core.ShardedGradScaler, got "
            f"{type(scaler).__name__}; replace torch.amp.GradScaler(...) by "
            "ShardedGradScaler(...) with the same arguments."
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"unscale_and_clip_ takes a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )


def _streamed_partial(
    stats: StreamingStats,
    counted: Any,
    p: float,
    registry: Registry,
    kernels: str | None,
    device: torch.device,
) -> torch.Tensor:
    if stats.norm_type != p:
        raise ValueError(
            f"the StreamingStats were computed for norm_type={stats.norm_type}, but "
            f"unscale_and_clip_ was asked for norm_type={p}; build them with the same norm_type"
        )
    remaining, partials = stats.split(counted)
    rest = pipe.local_partial(remaining, p, registry, kernels, device)
    streamed = stats.combine(partials, device)
    if streamed is None:
        return rest
    both = torch.stack([rest, streamed])
    return both.max() if math.isinf(p) else both.sum()


def unscale_and_clip_(
    scaler: ShardedGradScaler,
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    norm_type: float = 2.0,
    foreach: bool | None = None,
    *,
    stats: StreamingStats | None = None,
) -> torch.Tensor:
    """Do ``scaler.unscale_(optimizer)`` then ``clip_grad_norm_(params, max_norm)`` in one pass.

    Reads each (still scaled) local gradient of ``optimizer`` once, combines
    every rank's norm and overflow flag in ONE collective over the scaler's
    process group and backend, then either multiplies each gradient once by
    clip_coef / scale, or, for a fused optimizer, leaves them scaled and lets
    ``scaler.step(optimizer)`` pass it ``grad_scale = scale / clip_coef``.
    ``scaler.step()`` and ``scaler.update()`` then behave as after torch's
    ``unscale_`` + ``clip_grad_norm_``: the step is skipped on overflow and
    the scale moves the same way.

    Call it once per optimizer per iteration, after backward and before
    ``scaler.step(optimizer)``. After it, gradients of a fused optimizer are
    still scaled; read the returned norm rather than the gradients.

    Args:
        scaler: a :class:`shardscale.core.ShardedGradScaler` (its process group,
            backend, kernels and ``distinct_dims`` are used).
        optimizer: the optimizer whose parameters' gradients are clipped.
        max_norm: a number > 0; ``float('inf')`` only unscales and measures.
        norm_type: any p > 0, or ``float('inf')``.
        foreach: None: the scaler's kernels; True/False: the ``foreach``/``loop``
            kernels.
        stats: optional :class:`StreamingStats` that already read each FSDP2
            gradient in a post-accumulate-grad hook during backward, so only
            the collective and the multiply remain here (see
            [Note: streaming statistics]; docs/fused-step.md says when it pays).

    Returns:
        The true (unscaled) global norm as a 0-dim float32 tensor on the
        scale's device, identical on every rank; inf or nan when the step
        will be skipped. No host-device synchronisation happens here.
    """
    return _unscale_and_clip(scaler, optimizer, max_norm, norm_type, foreach, stats=stats)


def _unscale_and_clip(
    scaler: ShardedGradScaler,
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    norm_type: float,
    foreach: bool | None,
    *,
    stats: StreamingStats | None,
) -> torch.Tensor:
    """unscale_and_clip_, optionally with statistics streamed during backward."""
    _check_call(scaler, optimizer)
    limit = check_max_norm(max_norm)
    p = check_norm_type(norm_type)
    name = pipe.kernels_name(foreach, scaler._kernels_name)
    if not scaler.is_enabled():
        # Nothing is scaled: this is plain clipping with the scaler's group and backend.
        return clip_grad_norm_(
            list(optimizer_params(optimizer)),
            limit,
            p,
            process_group=scaler.process_group,
            backend=scaler.backend,
            distinct_dims=scaler._distinct_dims,
            kernels=name,
            registry=scaler._reg(),
        )
    scale = scaler._scale
    if scale is None:
        raise RuntimeError(
            "unscale_and_clip_() was called before the scale exists: call "
            "scaler.scale(loss).backward() earlier in the iteration."
        )
    stage = scaler._opt_state(optimizer).stage
    if stage is not OptState.READY:
        raise RuntimeError(
            f"this optimizer was already {stage.name.lower()} in this iteration (unscale_, "
            "unscale_and_clip_ or step ran); call unscale_and_clip_ once per optimizer, "
            "before scaler.step(optimizer), and call scaler.update() to start the next iteration."
        )
    registry = scaler._reg()
    backend = scaler.backend
    group = scaler.process_group
    with torch.no_grad():
        buckets = pipe.collect(
            optimizer_params(optimizer),
            scaler._adapter_context(),
            registry,
            backend,
            as_grads=False,
        )
        if stats is None:
            partial = pipe.local_partial(buckets.counted, p, registry, name, scale.device)
        else:
            partial = _streamed_partial(stats, buckets.counted, p, registry, name, scale.device)
        reduced = pipe.reduce_partial(partial, p, backend, group)
        found_inf = reduced.nonfinite.to(torch.float32)  # exactly 0 or 1: fused kernels test == 1
        inv_scale = scale.double().reciprocal().float()
        norm = pipe.root(reduced.partial, p) * inv_scale
        coef = torch.where(
            reduced.nonfinite,
            torch.ones_like(norm),
            pipe.clip_coefficient(norm, limit),
        )
        # Make the reported norm non-finite whenever the step will be skipped.
        reported = norm + torch.where(reduced.nonfinite, math.inf, 0.0)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            scaler._mark_unscaled(optimizer, found_inf, grad_scale=scale / coef, grad_norm=reported)
        else:
            pipe.multiply_(buckets.every, coef * inv_scale, registry, name)
            scaler._mark_unscaled(optimizer, found_inf, grad_norm=reported)
    return reported
