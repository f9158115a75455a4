"""Streaming statistics: read each FSDP2 gradient during backward, as soon as it is final.

[Note: streaming statistics]
FSDP2 assigns each parameter's sharded gradient right after its
reduce-scatter and then runs the parameter's post-accumulate-grad hooks, while
the rest of backward is still running. :class:`StreamingStats` hooks every
DTensor parameter and computes that gradient's partial Σ|g|^p (on the scaled
gradient, through the stats kernels) right there, so ``unscale_and_clip_``
only has the collective and the multiply left. A gradient that was not seen
by a hook in this iteration (plain tensors, whose DDP reduction happens after
their hook, or a gradient replaced after its hook ran) is read after backward
as usual, so the result never depends on the hooks having fired.

The statistics of a hooked gradient are recomputed each time its hook fires
(gradient accumulation over micro-batches re-fires it), and only the last
value is used. Gradients must not be changed between backward and
``unscale_and_clip_`` except by the hooks' own parameter's accumulation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from shardscale.clip._validate import check_norm_type

if TYPE_CHECKING:
    from shardscale.core import ShardedGradScaler

__all__ = ["StreamingStats"]


class StreamingStats:
    """Per-gradient statistics computed in post-accumulate-grad hooks during backward.

    Pass it to ``unscale_and_clip_(..., stats=stream)``. Call :meth:`remove` to
    take the hooks off again.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        scaler: ShardedGradScaler,
        *,
        norm_type: float = 2.0,
        kernels: str | None = None,
    ) -> None:
        from torch.distributed.tensor import DTensor

        self.norm_type = check_norm_type(norm_type)
        self._scaler = scaler
        self._kernels = kernels if kernels is not None else scaler._kernels_name
        # id(local grad tensor) -> (the tensor, its partial or None when this copy does not count)
        self._seen: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._handles: list[Any] = []
        #: How many partials computed by hooks the last :meth:`split` used.
        self.last_used = 0
        for param in params:
            if isinstance(param, DTensor) and param.requires_grad:
                hook = param.register_post_accumulate_grad_hook(self._hook)  # type: ignore[no-untyped-call]
                self._handles.append(hook)

    def _hook(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        registry = self._scaler._reg()
        shard = registry.adapter_for(param).describe(param, grad, self._scaler._adapter_context())
        local = shard.local
        partial = None
        if shard.counts:
            kernels = registry.kernels_for(local.device, self._kernels)
            with torch.no_grad():
                partial = kernels.partial_norm([local], self.norm_type)
        self._seen[id(local)] = (local, partial)

    def split(
        self, counted: Mapping[Any, Sequence[torch.Tensor]]
    ) -> tuple[dict[Any, list[torch.Tensor]], list[torch.Tensor]]:
        """(the counted gradients still to read, the partials already computed); forgets them."""
        remaining: dict[Any, list[torch.Tensor]] = {}
        partials = []
        for key, tensors in counted.items():
            for t in tensors:
                entry = self._seen.get(id(t))
                if entry is not None and entry[0] is t and entry[1] is not None:
                    partials.append(entry[1])
                else:
                    remaining.setdefault(key, []).append(t)
        self._seen.clear()
        self.last_used = len(partials)
        return remaining, partials

    def combine(self, partials: list[torch.Tensor], device: torch.device) -> torch.Tensor | None:
        """Sum (or max, for the inf-norm) of ``partials`` on ``device``; None if there are none."""
        if not partials:
            return None
        stacked = torch.stack([p.reshape(()).to(device) for p in partials])
        return stacked.max() if math.isinf(self.norm_type) else stacked.sum()

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._seen.clear()
