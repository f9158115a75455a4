"""counting and coalescing, alone and composed, in one process over a real single-rank group."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch.distributed import ProcessGroup

from shardscale.collectives import (
    C10dBackend,
    CoalescingMiddleware,
    CollectiveRecord,
    CountingMiddleware,
    NcclBackend,
    chain_names,
    find_middleware,
)
from shardscale.core import (
    Handle,
    PluginNotFoundError,
    ReduceOp,
    ShardedGradScaler,
    ShardscaleError,
    get_registry,
)
from shardscale.core.plugins import CompletedHandle
from shardscale.core.step import VectorLayout

pytestmark = pytest.mark.usefixtures("world1")


class ThreeIdenticalRanks:
    """Test double standing in for 3 ranks holding the same data: SUM triples, MAX keeps.

    It lets one process check that coalescing copies each result back to the
    right tensor (a mix-up would show, since every input differs).
    """

    name: ClassVar[str] = "three"

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp, group: ProcessGroup | None
    ) -> Handle:
        self.seen.append(tensor)
        if op is ReduceOp.SUM:
            tensor.mul_(3)
        return CompletedHandle()

    def world_size(self, group: ProcessGroup | None) -> int:
        return 3

    def rank(self, group: ProcessGroup | None) -> int:
        return 0

    def group_ranks(self, group: ProcessGroup | None) -> tuple[int, ...]:
        return (0, 1, 2)


def test_registry_composes_left_to_right() -> None:
    backend = get_registry().make_backend("counting+coalescing+c10d")
    assert isinstance(backend, CountingMiddleware)
    assert isinstance(backend.inner, CoalescingMiddleware)
    assert isinstance(backend.inner.inner, C10dBackend)
    assert chain_names(backend) == "counting+coalescing+c10d"
    assert find_middleware(backend, CoalescingMiddleware) is backend.inner
    assert find_middleware(backend, "counting") is backend
    assert find_middleware(backend, C10dBackend) is backend.inner.inner


def test_find_middleware_names_the_chain_when_missing() -> None:
    backend = get_registry().make_backend("coalescing+c10d")
    with pytest.raises(
        PluginNotFoundError,
        match=r"no 'CountingMiddleware' in the backend chain 'coalescing\+c10d'",
    ):
        find_middleware(backend, CountingMiddleware)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("coalescing", "ends in the middleware 'coalescing'"),
        ("counting+c10d+gloo", "'c10d' is a backend, not a middleware"),
        ("countin+c10d", "no middleware named 'countin': misspelled or not installed"),
        ("counting+", "has an empty name"),
        ("counting+c10x", "no backend named 'c10x'"),
    ],
)
def test_bad_chains_are_refused_clearly(spec: str, fragment: str) -> None:
    with pytest.raises(ShardscaleError, match=fragment.replace("+", r"\+")):
        get_registry().make_backend(spec)


def test_counting_records_what_it_forwards() -> None:
    counting = CountingMiddleware(C10dBackend())
    a = torch.ones(5, dtype=torch.float16)
    b = torch.zeros(2, 3, dtype=torch.float64)
    counting.all_reduce(a, op=ReduceOp.SUM, group=None).wait()
    counting.all_reduce(b, op=ReduceOp.MAX, group=None).wait()
    assert counting.records == [
        CollectiveRecord(ReduceOp.SUM, 1, a.numel() * a.element_size(), torch.float16, 5, "cpu"),
        CollectiveRecord(ReduceOp.MAX, 1, b.numel() * b.element_size(), torch.float64, 6, "cpu"),
    ]
    assert counting.total_bytes == 5 * 2 + 6 * 8
    with pytest.raises(AttributeError):
        counting.records[0].numel = 1  # type: ignore[misc]  # frozen
    counting.reset()
    assert counting.records == []


def test_counting_records_nothing_when_the_inner_backend_refuses() -> None:
    counting = CountingMiddleware(NcclBackend())
    with pytest.raises(ShardscaleError):
        counting.all_reduce(torch.ones(1), op=ReduceOp.SUM, group=None)
    assert counting.records == []


def test_coalescing_issues_one_collective_per_group_op_dtype_in_program_order() -> None:
    inner = CountingMiddleware(ThreeIdenticalRanks())
    coalescing = CoalescingMiddleware(inner)
    gen = torch.Generator().manual_seed(0)
    requests = [
        (torch.randn(3, generator=gen), ReduceOp.SUM),
        (torch.randn(2, 2, generator=gen), ReduceOp.MAX),
        (torch.randn(4, generator=gen).double(), ReduceOp.SUM),
        (torch.randn(1, generator=gen), ReduceOp.SUM),
        (torch.randn(5, generator=gen)[::2], ReduceOp.SUM),  # non-contiguous view
        (torch.randn(2, generator=gen), ReduceOp.MAX),
    ]
    originals = [t.clone() for t, _ in requests]
    handles = [coalescing.all_reduce(t, op=op, group=None) for t, op in requests]
    assert coalescing.pending == len(requests)
    assert inner.records == []  # nothing leaves before a wait
    handles[3].wait()
    assert coalescing.pending == 0
    # Batches in the order of their first request: f32 SUM, f32 MAX, f64 SUM.
    assert [(r.op, r.dtype, r.numel) for r in inner.records] == [
        (ReduceOp.SUM, torch.float32, 3 + 1 + 3),
        (ReduceOp.MAX, torch.float32, 4 + 2),
        (ReduceOp.SUM, torch.float64, 4),
    ]
    for handle in handles:
        handle.wait()
    for (tensor, op), original in zip(requests, originals, strict=True):
        expected = original * 3 if op is ReduceOp.SUM else original
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0)


def test_a_lone_contiguous_request_is_reduced_in_place_without_a_copy() -> None:
    inner = ThreeIdenticalRanks()
    coalescing = CoalescingMiddleware(inner)
    tensor = torch.tensor([1.0, 2.0])
    coalescing.all_reduce(tensor, op=ReduceOp.SUM, group=None).wait()
    assert inner.seen[0] is tensor
    assert tensor.tolist() == [3.0, 6.0]


def test_explicit_flush_and_repeated_waits() -> None:
    inner = CountingMiddleware(C10dBackend())
    coalescing = CoalescingMiddleware(inner)
    a, b = torch.tensor([1.0]), torch.tensor([2.0])
    ha = coalescing.all_reduce(a, op=ReduceOp.SUM, group=None)
    hb = coalescing.all_reduce(b, op=ReduceOp.SUM, group=None)
    coalescing.flush()
    assert len(inner.records) == 1 and coalescing.pending == 0
    hb.wait()
    hb.wait()
    ha.wait()
    assert (a.item(), b.item()) == (1.0, 2.0)
    coalescing.flush()  # nothing queued: nothing issued
    assert len(inner.records) == 1


def test_groups_are_batched_separately() -> None:
    import torch.distributed as dist

    sub = dist.new_group([0])
    inner = CountingMiddleware(C10dBackend())
    coalescing = CoalescingMiddleware(inner)
    tensors = [torch.ones(2) for _ in range(4)]
    handles = [
        coalescing.all_reduce(t, op=ReduceOp.SUM, group=g)
        for t, g in zip(tensors, [None, sub, None, sub], strict=True)
    ]
    handles[0].wait()
    assert [r.numel for r in inner.records] == [4, 4]


def test_bad_input_to_coalescing_leaves_the_queue_unchanged() -> None:
    coalescing = CoalescingMiddleware(C10dBackend())
    coalescing.all_reduce(torch.ones(1), op=ReduceOp.SUM, group=None)
    with pytest.raises(TypeError):
        coalescing.all_reduce(3.0, op=ReduceOp.SUM, group=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown reduction"):
        coalescing.all_reduce(torch.ones(1), op="prod", group=None)  # type: ignore[arg-type]
    assert coalescing.pending == 1
    coalescing.flush()


def test_a_failed_flush_is_reported_on_every_affected_handle() -> None:
    coalescing = CoalescingMiddleware(NcclBackend())
    h1 = coalescing.all_reduce(torch.ones(1), op=ReduceOp.SUM, group=None)
    h2 = coalescing.all_reduce(torch.ones(1), op=ReduceOp.MAX, group=None)
    with pytest.raises(ShardscaleError, match="CUDA tensors only"):
        h1.wait()
    with pytest.raises(RuntimeError, match="never issued") as info:
        h2.wait()
    assert isinstance(info.value.__cause__, ShardscaleError)
    with pytest.raises(RuntimeError, match="failed"):
        h1.wait()
    assert coalescing.pending == 0


def _scaler_iteration(scaler: ShardedGradScaler, optimizers: list[torch.optim.Optimizer]) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.full_like(p, 0.5)
    for opt in optimizers:
        scaler.unscale_(opt)
    for opt in optimizers:
        scaler.step(opt)
    scaler.update()


def test_scaler_with_two_optimizers_issues_one_coalesced_collective_per_step() -> None:
    scaler = ShardedGradScaler("cpu", init_scale=4.0, backend="coalescing+counting+c10d")
    counting = find_middleware(scaler.backend, CountingMiddleware)
    p1, p2 = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    optimizers: list[torch.optim.Optimizer] = [
        torch.optim.SGD([p1], lr=0.1),
        torch.optim.SGD([p2], lr=0.1),
    ]
    scaler.scale(torch.ones(()))  # creates the scale tensor
    for step in range(1, 4):
        _scaler_iteration(scaler, optimizers)
        assert len(counting.records) == step
    # Two optimizers' step vectors (5 slots per rank + 1, float64; one rank here) in one.
    world = scaler.backend.world_size(None)
    assert {(r.op, r.numel, r.dtype) for r in counting.records} == {
        (ReduceOp.SUM, 2 * (VectorLayout(world).size), torch.float64)
    }
    # Every step ran: grads were finite (0.5 / scale each time).
    torch.testing.assert_close(p1.detach(), torch.ones(3) - 3 * 0.1 * 0.5 / 4.0)


def test_counting_outside_coalescing_sees_the_requests() -> None:
    scaler = ShardedGradScaler("cpu", init_scale=4.0, backend="counting+coalescing+c10d")
    outer = find_middleware(scaler.backend, CountingMiddleware)
    p1, p2 = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    optimizers: list[torch.optim.Optimizer] = [torch.optim.SGD([p], lr=0.1) for p in (p1, p2)]
    scaler.scale(torch.ones(()))
    _scaler_iteration(scaler, optimizers)
    world = scaler.backend.world_size(None)
    assert [r.numel for r in outer.records] == [VectorLayout(world).size] * 2
