"""Core's built-in stats kernels (``foreach``, ``loop``, ``blas-dot``) and how one is chosen per device.

The automatic choice is core's alone: no other shardscale distribution registers
kernels, so installing or blocking one cannot change which kernels compute CPU norms.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from tolerances import norm_rtol

from shardscale.core import ForeachKernels, Registry, get_registry
from shardscale.core.plugins import BlasDotKernels, LoopKernels


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


def test_core_registers_loop_kernels_below_foreach() -> None:
    registry = get_registry()
    assert "loop" in registry.names("kernels")
    # On the CPU the dot-product kernels outrank foreach; loop is never automatic.
    assert registry.kernels_for(torch.device("cpu")).name == "blas-dot"
    assert registry.kernels_for(torch.device("meta")).name == "foreach"
    assert registry.kernels_for(torch.device("cpu"), "loop").name == "loop"
    info = [i for i in registry.items() if i.kind == "kernels" and i.name == "loop"]
    assert info and info[0].distribution == "shardscale-core"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_blas_dot_two_norm_matches_foreach(dtype: torch.dtype) -> None:
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


_CHOICE = """
import json, torch
from shardscale.core import get_registry
reg = get_registry()
k = reg.kernels_for(torch.device("cpu"))
owner = [i.distribution for i in reg.items() if i.kind == "kernels" and i.name == k.name]
print(json.dumps({"name": k.name, "owner": owner, "failures": [f.name for f in reg.failures()]}))
"""


def _cpu_choice(disable: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "SHARDSCALE_DISABLE_PLUGINS"}
    if disable is not None:
        env["SHARDSCALE_DISABLE_PLUGINS"] = disable
    out = subprocess.run(
        [sys.executable, "-c", _CHOICE],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_cpu_kernels_do_not_depend_on_which_distributions_are_installed() -> None:
    # A process with every distribution, one with shardscale-clip blocked before import (as if
    # not installed) and one with only core's plugin: the same kernels compute CPU norms.
    everything = _cpu_choice(None)
    without_clip = _cpu_choice("shardscale-clip")
    core_only = Registry(load_entry_points=False).kernels_for(torch.device("cpu"))
    assert everything["name"] == without_clip["name"] == core_only.name == "blas-dot"
    assert everything["owner"] == without_clip["owner"] == ["shardscale-core"]


def test_no_other_distribution_registers_core_kernel_names() -> None:
    owners = {i.name: i.distribution for i in get_registry().items() if i.kind == "kernels"}
    for name in ("foreach", "loop", "blas-dot"):
        assert owners.get(name) == "shardscale-core", owners


@pytest.mark.parametrize("sizes", [(40_000, 50_000), (3, 40_000, 5)], ids=["all-dot", "mixed"])
def test_blas_dot_flags_nonfinite_in_large_and_small_tensors(sizes: tuple[int, ...]) -> None:
    from shardscale.core._blas_kernels import DOT_MIN_NUMEL

    assert max(sizes) >= DOT_MIN_NUMEL  # at least one tensor takes the dot product
    gen = torch.Generator().manual_seed(11)
    ts = [torch.randn(n, generator=gen) for n in sizes]
    ts[0][1] = math.inf  # first tensor: inf
    ts[-1][2] = math.nan  # last tensor: nan
    got = BlasDotKernels().tensor_norms(ts, 2.0)
    assert math.isinf(float(got[0])) and math.isnan(float(got[-1]))
    for x, t in list(zip(got, ts, strict=True))[1:-1]:
        exact = float(t.double().pow(2).sum().sqrt())
        assert abs(float(x) - exact) <= norm_rtol(t.numel(), torch.float32, 2.0) * exact
