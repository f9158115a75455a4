"""The nccl backend on a real single-rank NCCL group (skipped without CUDA and NCCL)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardscale.collectives import (
    CoalescingMiddleware,
    CountingMiddleware,
    GlooBackend,
    NcclBackend,
)
from shardscale.core import BackendUnavailableError, ReduceOp, get_registry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        NcclBackend.unavailable_reason() is not None,
        reason=f"nccl backend unusable here: {NcclBackend.unavailable_reason()}",
    ),
    pytest.mark.usefixtures("world1"),
]


@pytest.fixture(scope="module")
def nccl_group() -> dist.ProcessGroup:
    torch.cuda.set_device(0)
    return dist.new_group(backend="nccl")


def test_nccl_reduces_cuda_tensors_on_an_nccl_group(nccl_group: dist.ProcessGroup) -> None:
    backend = get_registry().make_backend("counting+nccl")
    tensor = torch.tensor([1.0, -3.0], device="cuda")
    backend.all_reduce(tensor, op=ReduceOp.MAX, group=nccl_group).wait()
    torch.cuda.synchronize()
    assert tensor.tolist() == [1.0, -3.0]
    assert isinstance(backend, CountingMiddleware)
    assert [(r.device, r.numel) for r in backend.records] == [("cuda", 2)]


def test_coalescing_over_nccl(nccl_group: dist.ProcessGroup) -> None:
    inner = CountingMiddleware(NcclBackend())
    coalescing = CoalescingMiddleware(inner)
    tensors = [torch.full((3,), float(i), device="cuda") for i in range(4)]
    handles = [coalescing.all_reduce(t, op=ReduceOp.SUM, group=nccl_group) for t in tensors]
    handles[-1].wait()
    for h in handles:
        h.wait()
    torch.cuda.synchronize()
    assert len(inner.records) == 1 and inner.records[0].numel == 12
    assert [t[0].item() for t in tensors] == [0.0, 1.0, 2.0, 3.0]


def test_gloo_refuses_the_nccl_group(nccl_group: dist.ProcessGroup) -> None:
    with pytest.raises(BackendUnavailableError, match="uses 'nccl' for cuda tensors"):
        GlooBackend().all_reduce(torch.ones(1, device="cuda"), op=ReduceOp.SUM, group=nccl_group)


def test_nccl_refuses_the_default_gloo_group() -> None:
    with pytest.raises(BackendUnavailableError, match="uses 'gloo' for cuda tensors"):
        NcclBackend().all_reduce(torch.ones(1, device="cuda"), op=ReduceOp.SUM, group=None)
