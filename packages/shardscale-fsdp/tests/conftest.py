"""A world-size-1 gloo process group, started once per test module.

These tests run in one process so that shardscale-fsdp can be tested alone
(without shardscale-collectives): scalers use ``backend="local"``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def world1() -> Iterator[None]:
    """An initialized default group of one rank (gloo, in-memory store)."""
    if dist.is_initialized():  # another module left one behind: reuse it
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
