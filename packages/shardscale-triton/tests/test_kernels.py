"""The Triton kernels against a float64 reference and the ``foreach`` kernels.

On CPU tensors through Triton's interpreter in CI, compiled on a CUDA device
with ``-m gpu`` (the ``device`` fixture, see conftest.py). The cases are small
on purpose: the interpreter runs each program in numpy.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shardscale.core import ForeachKernels
from shardscale.core.testing import HostReadRecorder
from shardscale.triton import TritonKernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
NORMS = [1.0, 2.0, 3.0, 0.5, math.inf]
#: Small blocks: many programs, several blocks per tensor, at interpreter-friendly sizes.
BLOCK = 64


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype is torch.float64 else torch.float32


def norm_rtol(numel: int, dtype: torch.dtype, p: float, *, block: int = BLOCK) -> float:
    """Bound on the relative error of one tensor's p-norm from these kernels.

    Summation: each block sums at most ``block`` terms, then the last program
    adds the per-block partials; recursive or tree summation of n non-negative
    terms errs by at most (n - 1)·u in the accumulation precision (u = eps/2),
    and forming each term (|x|, x², or (|x|/m)^p) adds a few u: (n + 8)·u as in
    integration_tests/tolerances.py. The root divides the relative error by p
    and adds u. For p other than 1 and 2 each term is exp2(p·log2 y) with
    y = |x|/m ≤ 1: the computed log2 is off by ≤ u·|log2 y| + u, so the term is
    off by ≤ ln2·(p·|log2 y| + 2)·u·y^p ≤ (0.37 + 1.4·y^p)·u (the maximum of
    y^p·|ln y^p| is 1/e), and so is each per-block factor (m_b/M)^p; against a
    sum ≥ 1 (the peak's term is 1) that adds (0.4·(n + blocks) + 3)·u, less
    than the summation's own bound again, hence the factor 2. Each gives the
    bound on its own; the inf-norm is a max, exact up to the final rounding.
    """
    u = torch.finfo(_acc(dtype)).eps / 2
    if math.isinf(p):
        return u
    base = (numel + 8) * u * max(1.0, 1.0 / p) * 2 + u
    return base if p in (1.0, 2.0) and dtype is not torch.float64 else 2 * base


def _inputs(dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    """Empty, one element, sizes around and across the block, and non-contiguous layouts."""
    gen = torch.Generator().manual_seed(0)
    sizes = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5]
    out = [(torch.randn(n, generator=gen) * 3).to(device, dtype) for n in sizes]
    out.append(torch.randn(9, 13, generator=gen).to(device, dtype).t())  # dense, permuted
    out.append(torch.randn(10, 14, generator=gen).to(device, dtype)[:, ::3])  # strided: copied
    return out


def _exact(tensors: list[torch.Tensor], p: float) -> list[float]:
    out = []
    for t in tensors:
        v = t.detach().cpu().double().reshape(-1)
        if v.numel() == 0:
            out.append(0.0)
        elif math.isinf(p):
            out.append(float(v.abs().max()))
        else:
            # float64 with the peak factored out: an exact enough reference for any p.
            peak = float(v.abs().max())
            out.append(peak * float(((v.abs() / peak) ** p).sum()) ** (1 / p) if peak else 0.0)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", NORMS)
def test_norms_match_float64_and_foreach(device: str, dtype: torch.dtype, p: float) -> None:
    xs = _inputs(dtype, device)
    kernels = TritonKernels(block=BLOCK)
    got = kernels.tensor_norms(xs, p)
    want = ForeachKernels().tensor_norms(xs, p)
    assert got.dtype is _acc(dtype) and got.shape == (len(xs),) and got.device.type == device
    for i, (g, w, exact) in enumerate(zip(got.tolist(), want.tolist(), _exact(xs, p), strict=True)):
        bound = norm_rtol(xs[i].numel(), dtype, p)
        assert abs(g - exact) <= bound * exact, (i, g, exact)
        # foreach is bounded by the same kind of bound: the two are within the sum of both.
        assert abs(g - w) <= 2 * bound * max(exact, abs(w)), (i, g, w)
    assert got[0] == 0.0  # the empty tensor


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_a_nonfinite_element_anywhere_marks_only_its_tensor(
    device: str, dtype: torch.dtype, bad: float
) -> None:
    kernels, ref = TritonKernels(block=BLOCK), ForeachKernels()
    clean = _inputs(dtype, device)
    clean_norms = {p: kernels.tensor_norms(clean, p) for p in (2.0, 3.0, math.inf)}
    target = 5  # 3 blocks and a tail
    for pos in (0, clean[target].numel() // 2, clean[target].numel() - 1):
        xs = [t.clone() for t in clean]
        xs[target][pos] = bad
        for p in (2.0, 3.0, math.inf):
            got = kernels.tensor_norms(xs, p)
            if math.isnan(bad):
                assert math.isnan(got[target]), (pos, p)
            else:
                assert got[target] == math.inf, (pos, p)
            others = [i for i in range(len(xs)) if i != target]
            assert torch.equal(got[others], clean_norms[p][others])
        # The unscale flags it too, and scales exactly as torch's kernel does.
        a, b = [t.clone() for t in xs], [t.clone() for t in xs]
        flag_a = torch.zeros((), device=device)
        flag_b = torch.zeros((), device=device)
        inv = torch.full((), 0.125, device=device)
        kernels.unscale_and_check_(a, flag_a, inv)
        ref.unscale_and_check_(b, flag_b, inv)
        assert float(flag_a) == float(flag_b) == 1.0
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_apply_is_in_place_and_bit_identical_to_foreach(device: str, dtype: torch.dtype) -> None:
    kernels, ref = TritonKernels(block=BLOCK), ForeachKernels()
    xs = _inputs(dtype, device)
    base = xs[-1]._base
    assert base is not None
    base_before = base.clone()
    ptrs = [t.data_ptr() for t in xs]
    a, b = xs, [t.clone() for t in xs]
    for coef in (0.37, 1.0 / 3.0, 1.0):
        factor = torch.full((), coef, device=device)
        kernels.mul_(a, factor)
        ref.mul_(b, factor)
        assert _same_bits(a, b), coef
        flag = torch.zeros((), device=device)
        flag_ref = torch.zeros((), device=device)
        kernels.unscale_and_check_(a, flag, factor)
        ref.unscale_and_check_(b, flag_ref, factor)
        assert _same_bits(a, b) and float(flag) == float(flag_ref) == 0.0
    # In place: the same memory; the strided view's parent changed only where the view is.
    assert [t.data_ptr() for t in a] == ptrs
    untouched = torch.ones_like(base, dtype=torch.bool)
    untouched[:, ::3] = False
    assert torch.equal(base[untouched], base_before[untouched])
    assert not torch.equal(base[:, ::3], base_before[:, ::3])


def test_an_existing_found_inf_is_kept(device: str) -> None:
    kernels = TritonKernels(block=BLOCK)
    xs = _inputs(torch.float32, device)
    flag = torch.ones((), device=device)  # an earlier optimizer's overflow
    kernels.unscale_and_check_(xs, flag, torch.full((), 0.5, device=device))
    assert float(flag) == 1.0


def test_mixed_dtypes_and_the_default_block(device: str) -> None:
    kernels = TritonKernels()  # 4096 elements per program
    gen = torch.Generator().manual_seed(1)
    xs = [
        torch.randn(4096 * 2 + 7, generator=gen).to(device),
        torch.randn(33, generator=gen).to(device, torch.bfloat16),
        torch.randn(5, generator=gen).to(device, torch.float64),
    ]
    got = kernels.tensor_norms(xs, 2.0)
    # The reference reads one tensor per call: foreach takes one dtype per list (StatsKernels'
    # contract), while the Triton kernels also accept a mixed list.
    want = [ForeachKernels().tensor_norms([t], 2.0)[0] for t in xs]
    assert got.dtype is torch.float64  # float64 when any tensor is, as the engine's norm
    for i, t in enumerate(xs):
        bound = norm_rtol(t.numel(), t.dtype, 2.0, block=4096)
        assert abs(float(got[i]) - float(want[i])) <= 2 * bound * float(want[i])


class _Counting:
    """Stands in for a jitted kernel and counts ``kernel[grid](...)`` launches."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.launches = fn, 0

    def __getitem__(self, grid: Any) -> Any:
        self.launches += 1
        return self.fn[grid]


def test_one_launch_per_call_and_the_table_is_reused(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardscale.triton import _kernels

    kernels = TritonKernels(block=BLOCK)
    xs = _inputs(torch.float32, device)[:-1]  # every tensor dense: no copies
    kernels.tensor_norms(xs, 2.0)  # loads triton and builds the table
    jit = _kernels._load_triton().jit
    stats, scale = _Counting(jit.stats_kernel), _Counting(jit.scale_kernel)
    monkeypatch.setattr(jit, "stats_kernel", stats)
    monkeypatch.setattr(jit, "scale_kernel", scale)
    built = []
    real_layout = _kernels._Layout
    monkeypatch.setattr(
        _kernels, "_Layout", lambda *a, **k: built.append(1) or real_layout(*a, **k)
    )
    for p in (1.0, 2.0, 3.0, math.inf):
        kernels.tensor_norms(xs, p)
    factor = torch.full((), 0.5, device=device)
    kernels.mul_(xs, factor)
    kernels.unscale_and_check_(xs, torch.zeros((), device=device), factor)
    assert (stats.launches, scale.launches) == (4, 2)
    assert built == []  # same addresses and sizes: the device table is cached


def test_bad_input_is_refused_with_the_fix(device: str) -> None:
    kernels = TritonKernels(block=BLOCK)
    with pytest.raises(TypeError, match=r"int64.*kernels='foreach'"):
        kernels.tensor_norms([torch.ones(3, dtype=torch.int64, device=device)], 2.0)
    with pytest.raises(ValueError, match="norm_type must be > 0"):
        kernels.tensor_norms([torch.ones(3, device=device)], 0.0)
    x = torch.ones(3, device=device)
    with pytest.raises(ValueError, match="float32 tensor"):
        kernels.unscale_and_check_([x], torch.zeros((), dtype=torch.float64, device=device), x[0])
    assert torch.equal(x, torch.ones(3, device=device))  # nothing was scaled
    with pytest.raises(ValueError, match="power of two"):
        TritonKernels(block=100)
    assert kernels.tensor_norms([], 2.0).shape == (0,)


#: aten ops that make the host wait for a device value (integration_tests/test_no_host_sync.py).


def test_no_host_sync_in_any_call(device: str) -> None:
    kernels = TritonKernels(block=BLOCK)
    xs = _inputs(torch.float32, device)[:-1]
    factor = torch.full((), 0.5, device=device)
    flag = torch.zeros((), device=device)
    kernels.tensor_norms(xs, 2.0)  # first use: triton loads, the self-check runs (CUDA)
    with HostReadRecorder() as ops:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            for p in (1.0, 2.0, 3.0, math.inf):
                kernels.tensor_norms(xs, p)
            kernels.mul_(xs, factor)
            kernels.unscale_and_check_(xs, flag, factor)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    assert ops.seen == []


@pytest.mark.gpu
def test_cuda_engine_step_launches_each_kernel_once() -> None:
    """On a GPU: one statistics launch and one apply launch for a whole step, no host sync."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from torch.profiler import ProfilerActivity, profile

    from shardscale.core import get_registry
    from shardscale.core.step import Apply, StepConfig, StepRequest, run_step

    registry = get_registry()
    assert registry.kernels_for(torch.device("cuda")).name == "triton"
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen).cuda() for n in (1, 4097, 100_000, 0, 3)]
    config = StepConfig(backend=registry.make_backend("local"), registry=registry)
    scale = torch.full((), 1024.0, device="cuda")

    def step() -> Any:
        return run_step(
            grads,
            config,
            StepRequest(
                apply=Apply.MULTIPLY, norm_type=2.0, max_norm=1.0, scale=scale, as_grads=True
            ),
        )

    step()  # compile and self-check first
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert sum("stats_kernel" in n for n in names) == 1, names
    assert sum("scale_kernel" in n for n in names) == 1, names
