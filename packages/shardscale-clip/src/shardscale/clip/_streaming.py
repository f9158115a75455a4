"""Streaming statistics: read each FSDP2 gradient during backward, as soon as it is final.

[Note: streaming statistics]
FSDP2 assigns each parameter's sharded gradient right after its
reduce-scatter and then runs the parameter's post-accumulate-grad hooks, while
the rest of backward is still running. :class:`StreamingStats` hooks every
DTensor parameter and reads that gradient right there, as the step engine
would (``shardscale.core.step.read_tensor_norm``: its norm, whose finiteness is
the overflow flag), so ``unscale_and_clip_`` only has the collective and the
multiply left. Every local gradient is read, counted or not: a replica's
inf must stop the step as surely as a counted one's. A gradient that was not
seen by a hook in this iteration (plain tensors, whose DDP reduction happens
after their hook, or a gradient replaced after its hook ran) is read after
backward as usual, so the result never depends on the hooks having fired.

The statistics of a hooked gradient are recomputed each time its hook fires
(gradient accumulation over micro-batches re-fires it), and only the last
value is used. Gradients must not be changed between backward and
``unscale_and_clip_`` except by the hooks' own parameter's accumulation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from shardscale.core.step import check_norm_type, read_tensor_norm

if TYPE_CHECKING:
    from shardscale.core import ShardedGradScaler

__all__ = ["StreamingStats"]


class StreamingStats:
    """Per-gradient norms computed in post-accumulate-grad hooks during backward.

    Pass it to ``unscale_and_clip_(..., stats=stream)`` (it implements
    ``shardscale.core.step.PrecomputedNorms``). Call :meth:`remove` to take the
    hooks off again.
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
        self._kernels = kernels
        # id(local grad tensor) -> (the tensor, its norm); identity is re-checked on lookup.
        self._seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._handles: list[Any] = []
        #: How many norms computed by hooks the last step used.
        self.last_used = 0
        self._stepped = False  # a step looked values up since the last hook
        for param in params:
            if isinstance(param, DTensor) and param.requires_grad:
                hook = param.register_post_accumulate_grad_hook(self._hook)  # type: ignore[no-untyped-call]
                self._handles.append(hook)

    def _hook(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        if self._stepped:  # the first hook of a new iteration: forget the last one's leftovers
            self._stepped = False
            self._seen.clear()
            self.last_used = 0
        config = self._scaler.step_config
        if self._kernels is not None:
            import dataclasses

            config = dataclasses.replace(config, kernels=self._kernels)
        shard = config.registry.adapter_for(param).describe(param, grad, config.adapter_context())
        with torch.no_grad():
            self._seen[id(shard.local)] = (
                shard.local,
                read_tensor_norm(shard.local, self.norm_type, config),
            )

    def lookup(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The norm a hook read for exactly ``tensor`` in this iteration, or None; forgets it."""
        if not self._stepped:
            self._stepped = True
            self.last_used = 0
        entry = self._seen.pop(id(tensor), None)
        if entry is None or entry[0] is not tensor:
            return None
        self.last_used += 1
        return entry[1]

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._seen.clear()
