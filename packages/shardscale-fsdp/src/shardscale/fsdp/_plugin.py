"""shardscale-fsdp's plugin: gradient adapters for DTensor (FSDP2, HSDP, TP) and FSDP1 parameters.

DDP, ``replicate`` and unwrapped parameters are plain tensors, which
shardscale-core's own ``plain`` adapter already describes (replicated over the
reduction group, counted on its rank 0).
"""

from __future__ import annotations

from collections.abc import Sequence

from shardscale.core import hookimpl
from shardscale.fsdp._dtensor import DTensorAdapter
from shardscale.fsdp._fsdp1 import Fsdp1Adapter

__all__ = ["shardscale_grad_adapters"]


@hookimpl
def shardscale_grad_adapters() -> Sequence[object]:
    """The FSDP1 adapter (priority 30) and the DTensor adapter (priority 20)."""
    return [Fsdp1Adapter(), DTensorAdapter()]
