"""The c10d, gloo and nccl backends in one process over a real single-rank gloo group."""

from __future__ import annotations

import importlib.metadata as md

import pytest
import torch
import torch.distributed as dist

from shardscale.collectives import (
    C10dBackend,
    CountingMiddleware,
    GlooBackend,
    NcclBackend,
    WorkHandle,
)
from shardscale.core import BackendUnavailableError, ReduceOp, get_registry
from shardscale.core.testing import COUNTING_GLOO, CountingGlooGroup, counting_gloo_group

pytestmark = pytest.mark.usefixtures("world1")


def test_registry_lists_our_backends_and_middleware() -> None:
    registry = get_registry()
    assert {"c10d", "gloo", "nccl"} <= set(registry.names("backend"))
    assert {"counting", "coalescing"} <= set(registry.names("middleware"))
    ours = {i.name: i for i in registry.items() if i.distribution == "shardscale-collectives"}
    assert set(ours) == {"c10d", "gloo", "nccl", "counting", "coalescing"}
    version = md.version("shardscale-collectives")
    assert {i.version for i in ours.values()} == {version}
    assert registry.backend_class("c10d") is C10dBackend
    assert registry.backend_class("shardscale-collectives:gloo") is GlooBackend


def test_nccl_availability_matches_this_machine() -> None:
    if not torch.cuda.is_available():
        expected: str | None = "CUDA is not available"
    elif not dist.is_nccl_available():
        expected = "NCCL is not available in this torch build"
    else:
        expected = None
    assert NcclBackend.unavailable_reason() == expected
    assert C10dBackend.unavailable_reason() is None
    assert GlooBackend.unavailable_reason() is None
    if expected is not None:
        with pytest.raises(BackendUnavailableError, match=expected):
            get_registry().make_backend("nccl")
        item = next(i for i in get_registry().items() if i.name == "nccl")
        assert not item.usable and item.reason == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX])
def test_c10d_reduces_in_place_and_returns_work_handle(dtype: torch.dtype, op: ReduceOp) -> None:
    backend = C10dBackend()
    source = (torch.arange(6) - 2).to(dtype).reshape(2, 3)
    tensor = source.clone()
    handle = backend.all_reduce(tensor, op=op, group=None)
    assert isinstance(handle, WorkHandle)
    handle.wait()
    handle.wait()  # idempotent
    # One rank: SUM and MAX over a single contribution are the contribution itself.
    assert torch.equal(tensor, source)


def test_c10d_group_queries() -> None:
    backend = C10dBackend()
    assert backend.world_size(None) == dist.get_world_size() == 1
    assert backend.rank(None) == 0
    assert backend.group_ranks(None) == (0,)
    sub = dist.new_group([0])
    assert backend.group_ranks(sub) == (0,)
    assert backend.world_size(sub) == 1


def test_c10d_refuses_bad_input_without_issuing() -> None:
    counting = CountingMiddleware(C10dBackend())
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        counting.all_reduce([1.0], op=ReduceOp.SUM, group=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown reduction 'avg'"):
        counting.all_reduce(torch.ones(1), op="avg", group=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dense"):
        counting.all_reduce(torch.ones(2).to_sparse(), op=ReduceOp.SUM, group=None)
    assert counting.records == []


def test_op_given_as_string_is_accepted() -> None:
    tensor = torch.tensor([2.0])
    C10dBackend().all_reduce(tensor, op="max", group=None).wait()  # type: ignore[arg-type]
    assert tensor.item() == 2.0


def test_gloo_accepts_a_gloo_group() -> None:
    tensor = torch.tensor([1.5, -2.0])
    GlooBackend().all_reduce(tensor, op=ReduceOp.SUM, group=None).wait()
    assert tensor.tolist() == [1.5, -2.0]
    GlooBackend().check_group(None, device_type="cpu")


def test_nccl_on_a_gloo_group_says_what_it_found_and_how_to_fix() -> None:
    backend = NcclBackend()
    with pytest.raises(BackendUnavailableError, match="CUDA tensors only, got a cpu tensor"):
        backend.all_reduce(torch.ones(1), op=ReduceOp.SUM, group=None)
    with pytest.raises(BackendUnavailableError) as info:
        backend.check_group(None, device_type="cuda")
    message = str(info.value)
    assert "needs a process group using nccl" in message
    # The default group here is gloo for every device.
    assert "uses 'gloo' for cuda tensors" in message
    assert "backend='nccl'" in message and "'c10d'" in message


def test_custom_torch_backend_is_reached_through_c10d() -> None:
    group = counting_gloo_group()
    assert dist.get_backend(group) == COUNTING_GLOO
    before = CountingGlooGroup.calls
    tensor = torch.tensor([3.0, 4.0])
    C10dBackend().all_reduce(tensor, op=ReduceOp.SUM, group=group).wait()
    assert CountingGlooGroup.calls == before + 1
    assert tensor.tolist() == [3.0, 4.0]


def test_gloo_on_a_custom_group_says_what_it_found_and_how_to_fix() -> None:
    group = counting_gloo_group()
    before = CountingGlooGroup.calls
    with pytest.raises(BackendUnavailableError) as info:
        GlooBackend().all_reduce(torch.ones(1), op=ReduceOp.SUM, group=group)
    message = str(info.value)
    assert f"uses {COUNTING_GLOO!r} for cpu tensors" in message
    assert "needs a process group using gloo" in message
    assert "backend='gloo'" in message and "'c10d'" in message
    assert CountingGlooGroup.calls == before  # refused before anything was issued
