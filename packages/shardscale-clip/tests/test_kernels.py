"""The stats kernels this package registers, and that every clip call goes through the registry."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import pytest
import torch
from tolerances import norm_rtol

from shardscale.clip import LoopKernels, clip_grad_norm_, get_total_norm, unscale_and_clip_
from shardscale.core import ForeachKernels, ShardedGradScaler, get_registry, hookimpl


def tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(n, generator=gen).to(dtype) for n in (5, 17, 1, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("p", [0.5, 1.0, 2.0, 3.0, math.inf])
def test_loop_and_foreach_agree(dtype: torch.dtype, p: float) -> None:
    ts = tensors(dtype)
    a = LoopKernels().tensor_norms(ts, p)
    b = ForeachKernels().tensor_norms(ts, p)
    acc = torch.float64 if dtype is torch.float64 else torch.float32
    assert a.dtype is b.dtype is acc and a.shape == b.shape == (len(ts),)
    # Two kernels, each within the rounding bound of the exact per-tensor norm.
    for x, y, t in zip(a, b, ts, strict=True):
        torch.testing.assert_close(x, y, rtol=2 * norm_rtol(t.numel(), dtype, p), atol=0)
        exact = torch.linalg.vector_norm(t.double(), p)
        assert abs(float(x) - float(exact)) <= norm_rtol(t.numel(), dtype, p) * float(exact)


def test_loop_kernels_unscale_and_mul() -> None:
    ts = tensors(torch.float32)
    ts[1][4] = math.inf
    ref = [t.clone() for t in ts]
    found = torch.zeros(())
    LoopKernels().unscale_and_check_(ts, found, torch.tensor(0.25))
    ref_found = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(ref, ref_found, torch.tensor(0.25))
    assert float(found) == float(ref_found) == 1.0
    for a, b in zip(ts, ref, strict=True):
        assert torch.equal(a, b)
    LoopKernels().mul_(ts, torch.tensor(2.0))
    for a, b in zip(ts, ref, strict=True):
        assert torch.equal(a, b * 2)


def test_plugin_registers_loop_kernels_below_foreach() -> None:
    registry = get_registry()
    assert "loop" in registry.names("kernels")
    # On the CPU the dot-product kernels outrank foreach; loop is never automatic.
    assert registry.kernels_for(torch.device("cpu")).name == "blas-dot"
    assert registry.kernels_for(torch.device("meta")).name == "foreach"
    assert registry.kernels_for(torch.device("cpu"), "loop").name == "loop"
    info = [i for i in registry.items() if i.kind == "kernels" and i.name == "loop"]
    assert info and info[0].distribution == "shardscale-clip"


class SpyKernels(ForeachKernels):
    """Foreach kernels that record what they are asked to do (highest priority: chosen first)."""

    name: ClassVar[str] = "spy"
    priority: ClassVar[int] = 1000

    def __init__(self) -> None:
        self.reads = 0
        self.muls = 0

    def tensor_norms(self, tensors: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        self.reads += len(tensors)
        return super().tensor_norms(tensors, norm_type)

    def mul_(self, tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
        self.muls += len(tensors)
        super().mul_(tensors, coef)


class SpyPlugin:
    def __init__(self) -> None:
        self.kernels = SpyKernels()

    @hookimpl
    def shardscale_stats_kernels(self) -> Sequence[object]:
        return [self.kernels]


def test_every_read_and_multiply_goes_through_the_chosen_kernels() -> None:
    plugin = SpyPlugin()
    registry = get_registry()
    name = registry.register(plugin, name="clip-spy")
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        n_params = len(list(model.parameters()))
        model(torch.randn(3, 4)).sum().backward()
        get_total_norm([q.grad for q in model.parameters()])  # type: ignore[misc]
        assert (plugin.kernels.reads, plugin.kernels.muls) == (n_params, 0)
        clip_grad_norm_(model.parameters(), 1e-3)
        assert (plugin.kernels.reads, plugin.kernels.muls) == (2 * n_params, n_params)
        # One read and one multiply per gradient for an unfused optimizer...
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ShardedGradScaler("cpu", backend="local")
        scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        unscale_and_clip_(scaler, opt, 1.0)
        assert (plugin.kernels.reads, plugin.kernels.muls) == (3 * n_params, 2 * n_params)
        # ... and foreach=False bypasses it for the loop kernels.
        clip_grad_norm_(model.parameters(), 1e-3, foreach=False)
        assert (plugin.kernels.reads, plugin.kernels.muls) == (3 * n_params, 2 * n_params)
        # A fused optimizer: one read, no multiply.
        fused = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
        scaler.step(opt)
        scaler.update()
        scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        unscale_and_clip_(scaler, fused, 1.0)
        assert (plugin.kernels.reads, plugin.kernels.muls) == (4 * n_params, 2 * n_params)
    finally:
        registry.unregister(name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_blas_dot_two_norm_matches_foreach(dtype: torch.dtype) -> None:
    from shardscale.clip import BlasDotKernels

    gen = torch.Generator().manual_seed(7)
    ts = [torch.randn(n, generator=gen).to(dtype) * 300 for n in (0, 1, 17, 4096, 70001)]
    ts.append(torch.randn(33, 9, generator=gen).to(dtype).t())  # non-contiguous
    got = BlasDotKernels().tensor_norms(ts, 2.0)
    assert got.dtype is dtype and got.shape == (len(ts),)
    ref = ForeachKernels().tensor_norms(ts, 2.0)
    for x, y, t in zip(got, ref, ts, strict=True):
        exact = float(t.double().pow(2).sum().sqrt())
        bound = norm_rtol(t.numel(), dtype, 2.0)
        assert abs(float(x) - exact) <= bound * exact
        assert abs(float(x) - float(y)) <= 2 * bound * exact


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_blas_dot_keeps_the_overflow_signal(bad: float) -> None:
    from shardscale.clip import BlasDotKernels

    ts = [torch.ones(10), torch.tensor([1.0, bad, 2.0])]
    norms = BlasDotKernels().tensor_norms(ts, 2.0)
    assert bool(torch.isfinite(norms[0])) and not bool(torch.isfinite(norms[1]))


@pytest.mark.parametrize(
    ("dtype", "p"),
    [
        (torch.float16, 2.0),
        (torch.bfloat16, 2.0),
        (torch.float32, 1.0),
        (torch.float32, 3.0),
        (torch.float32, math.inf),
    ],
)
def test_blas_dot_defers_to_foreach_elsewhere(dtype: torch.dtype, p: float) -> None:
    from shardscale.clip import BlasDotKernels

    gen = torch.Generator().manual_seed(3)
    ts = [torch.randn(n, generator=gen).to(dtype) for n in (5, 300)]
    assert torch.equal(BlasDotKernels().tensor_norms(ts, p), ForeachKernels().tensor_norms(ts, p))
    assert BlasDotKernels().supports(torch.device("cpu"))
    assert not BlasDotKernels().supports(torch.device("cuda"))


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
def test_loop_kernels_skip_empty_shards_like_foreach(p: float) -> None:
    # Uneven FSDP sharding leaves zero-size local grads; torch's inf-norm rejects them alone.
    ts = [torch.zeros(0), torch.tensor([3.0, -4.0]), torch.zeros(0, 5)]
    got = LoopKernels().tensor_norms(ts, p)
    assert torch.equal(got, ForeachKernels().tensor_norms(ts, p))
    want = 4.0 if math.isinf(p) else (3.0**p + 4.0**p) ** (1 / p)
    assert got.tolist()[0] == got.tolist()[2] == 0.0
    assert got.tolist()[1] == pytest.approx(want, rel=norm_rtol(2, torch.float32, p))
    assert LoopKernels().tensor_norms([torch.zeros(0)], p).tolist() == [0.0]
