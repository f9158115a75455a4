"""c10d's group ranks are computed once per group, and never outlive it.

At 10^5 ranks building the rank tuple on every step cost milliseconds (docs/benchmark.md, the
scale table), so the backend keeps it per group; a group destroyed and re-created (a new
process group, perhaps at the same address) must get its own ranks.
"""

from __future__ import annotations

import gc

import pytest
import torch.distributed as dist

from shardscale.collectives import C10dBackend


def _fake_group(world: int, rank: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


@pytest.fixture
def no_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")


@pytest.mark.usefixtures("no_group")
def test_ranks_are_kept_per_group_and_renewed_with_it() -> None:
    backend = C10dBackend()
    for world in (4, 8, 4):
        _fake_group(world, rank=1)
        try:
            first = backend.group_ranks(None)
            assert first == tuple(range(world))
            assert backend.group_ranks(None) is first  # the same tuple, not rebuilt
            sub = dist.new_group([1, world - 1])
            assert backend.group_ranks(sub) == (1, world - 1)
        finally:
            dist.destroy_process_group()
            gc.collect()
