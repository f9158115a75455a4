"""shardscale.clip: gradient-norm clipping for sharded models, fused with unscaling.

Quick start::

    from shardscale.core import ShardedGradScaler
    from shardscale.clip import unscale_and_clip_

    scaler.scale(loss).backward()
    norm = unscale_and_clip_(scaler, optimizer, max_norm=1.0)   # one read, one collective
    scaler.step(optimizer)
    scaler.update()

Without a scaler, :func:`clip_grad_norm_` and :func:`get_total_norm` are drop-ins
for ``torch.nn.utils``'s that return the true global norm for FSDP2, FSDP1,
DDP, tensor-parallel and multi-mesh models.
"""

from __future__ import annotations

from shardscale.clip._fused import unscale_and_clip_
from shardscale.clip._norm import clip_grad_norm_, get_total_norm
from shardscale.clip._streaming import StreamingStats

# Core built-ins now; still importable from here for code written earlier (documented in core).
from shardscale.core.plugins import BlasDotKernels as BlasDotKernels
from shardscale.core.plugins import LoopKernels as LoopKernels

__all__ = [
    "get_total_norm",
    "clip_grad_norm_",
    "unscale_and_clip_",
    "StreamingStats",
]
