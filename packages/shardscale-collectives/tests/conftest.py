"""A world-size-1 gloo process group, started once per test module that asks for it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def world1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A real single-rank gloo default group (destroyed when the module ends)."""
    if dist.is_initialized():
        pytest.skip("a default process group is already initialized in this process")
    store_file = Path(tmp_path_factory.mktemp("store")) / "store"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.FileStore(str(store_file), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
