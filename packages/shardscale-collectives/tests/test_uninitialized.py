"""Without a process group: clear errors from c10d/gloo/nccl, and 'local' chosen automatically."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardscale.collectives import C10dBackend, GlooBackend, NcclBackend
from shardscale.core import BackendUnavailableError, LocalBackend, ReduceOp, get_registry
from shardscale.core.plugins import BACKEND_ENV


@pytest.fixture(autouse=True)
def _no_group() -> None:
    if dist.is_initialized():
        pytest.skip("a default process group is initialized in this process")


@pytest.mark.parametrize("backend", [C10dBackend(), GlooBackend()], ids=["c10d", "gloo"])
def test_backends_need_an_initialized_group(backend: C10dBackend) -> None:
    with pytest.raises(BackendUnavailableError, match=r"init_process_group\(\.\.\.\) first"):
        backend.all_reduce(torch.ones(1), op=ReduceOp.SUM, group=None)
    with pytest.raises(BackendUnavailableError, match="'local' backend"):
        backend.world_size(None)


def test_nccl_refuses_cpu_tensors_before_anything_else() -> None:
    with pytest.raises(BackendUnavailableError, match="CUDA tensors only"):
        NcclBackend().all_reduce(torch.ones(1), op=ReduceOp.SUM, group=None)


def test_automatic_choice_is_local_without_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert isinstance(get_registry().make_backend(), LocalBackend)
    # Naming c10d still builds it (the group may be created later); use fails clearly.
    assert isinstance(get_registry().make_backend("c10d"), C10dBackend)
