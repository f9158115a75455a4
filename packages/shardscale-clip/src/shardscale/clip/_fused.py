"""``unscale_and_clip_``: the scaler's unscale and norm clipping in one read and one collective.

[Note: the fused step]
torch's recipe ``scaler.unscale_(opt); clip_grad_norm_(params, max_norm)`` makes
three passes over gradient memory (unscale R+W, norm R, clip R+W) and at least
two collectives (overflow flag, norm). Here the *still scaled* gradients are
read once by the step engine (``shardscale.core.step.run_step``): per-tensor norms
and a non-finite flag over every local gradient go through ONE all-reduce, then

* norm = ‖s·g‖_p / s, coef = min(1, max_norm / (norm + 1e-6));
* an ordinary optimizer gets every local gradient multiplied once by coef / s
  (one R+W pass) and steps on what torch's recipe would have given it;
* an optimizer with ``_step_supports_amp_scaling`` (fused Adam/AdamW/SGD)
  gets nothing multiplied: ``scaler.step()`` hands it grad_scale = s / coef
  and found_inf, and it divides inside its own kernel;
* so does an unfused torch SGD/Adam/AdamW when asked (``fuse_optimizer=True``,
  on the scaler or per call): ``scaler.step()`` runs its step through torch's
  fused kernel ([Note: the apply folded into the optimizer] in
  shardscale.core). By default (False) it is multiplied like any other.

On overflow (any non-finite gradient on any rank, counted or not) coef is 1,
so the gradients end as torch's unscale_ leaves them, the optimizer skips the
step, the scale backs off in ``update()``, and the returned norm is inf or
nan: never a silent nan in the weights. This module only validates; the step
itself is ``ShardedGradScaler.unscale_(optimizer, max_norm=...)``.
"""

from __future__ import annotations

import torch

from shardscale.clip._streaming import StreamingStats
from shardscale.core import ShardedGradScaler
from shardscale.core.step import (
    check_max_norm,
    check_norm_type,
    eager,
    kernels_name,
    optimizer_params,
)

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


@eager
def unscale_and_clip_(
    scaler: ShardedGradScaler,
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    norm_type: float = 2.0,
    foreach: bool | None = None,
    *,
    stats: StreamingStats | None = None,
    fuse_optimizer: bool | None = None,
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
    still scaled, and so are those of a torch SGD/Adam/AdamW whose step the
    scaler runs through torch's fused kernel (``fuse_optimizer=True``); read
    the returned norm rather than the gradients then. The default multiplies
    them now, as torch's recipe leaves them.

    Args:
        scaler: a :class:`shardscale.core.ShardedGradScaler` (its process group,
            backend, kernels, ``distinct_dims`` and ``distinct_params`` are used).
        optimizer: the optimizer whose parameters' gradients are clipped.
        max_norm: a number > 0; ``float('inf')`` only unscales and measures.
        norm_type: any p > 0, or ``float('inf')``.
        foreach: None: the scaler's kernels; True/False: the ``foreach``/``loop``
            kernels.
        stats: optional :class:`StreamingStats` that already read each FSDP2
            gradient in a post-accumulate-grad hook during backward, so only
            the collective and the multiply remain here (see
            [Note: streaming statistics]; docs/fused-step.md says when it pays).
        fuse_optimizer: ``True``: leave an unfused torch SGD/Adam/AdamW's
            gradients scaled and its step to torch's fused kernel (the
            sync-free path; raising on every rank when it cannot; a step
            with step hooks registered multiplies instead); ``False``:
            multiply them now; ``None`` (default): the scaler's
            ``fuse_optimizer``, itself False by default.

    Returns:
        The true (unscaled) global norm as a 0-dim tensor on the scale's device
        (float64 if any gradient is float64, else float32), identical on every
        rank; inf or nan when the step will be skipped. No host-device
        synchronisation happens here.
    """
    _check_call(scaler, optimizer)
    if max_norm is None:
        check_max_norm(max_norm)  # the contract's TypeError: None would mean "unscale only"
    # max_norm/norm_type/kernels are checked by core's contract, in the step (one error text).
    if stats is not None and stats.norm_type != check_norm_type(norm_type):
        raise ValueError(
            f"the StreamingStats were computed for norm_type={stats.norm_type}, but "
            f"unscale_and_clip_ was asked for norm_type={norm_type}; build them with the same "
            "norm_type"
        )
    if not scaler.is_enabled():
        # Nothing is scaled: plain clipping with the scaler's whole configuration.
        return scaler.clip_grad_norm_(
            list(optimizer_params(optimizer)), max_norm, norm_type, foreach=foreach
        )
    kernels = kernels_name(foreach, scaler.step_config.kernels)
    norm = scaler.unscale_(
        optimizer,
        max_norm=max_norm,
        norm_type=norm_type,
        kernels=kernels,
        stats=stats,
        fuse_optimizer=fuse_optimizer,
    )
    assert norm is not None
    return norm
