"""Test-only shardscale plugin (shardscale-auto-backend): a backend offered for the automatic choice, below c10d."""

from __future__ import annotations

import torch.distributed as dist

from shardscale.core import hookimpl
from shardscale.core.plugins import CompletedHandle


class AutoBackend:
    """Reduces through torch.distributed; offered for the automatic choice below c10d (0)."""

    name = "auto-example"
    automatic_priority = -1

    def all_reduce(self, tensor, *, op, group):
        dist.all_reduce(
            tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group
        )
        return CompletedHandle()

    def world_size(self, group):
        return dist.get_world_size(group)

    def rank(self, group):
        return dist.get_rank(group)

    def group_ranks(self, group):
        return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


@hookimpl
def shardscale_collective_backends():
    return [AutoBackend]
