"""unscale_and_clip_ against torch's ``scaler.unscale_`` + ``clip_grad_norm_``, in one process.

Two identical models train on identical data, one with torch's recipe and one
with ours, with inf/nan injected at chosen steps. The scale trajectories must
be identical, the norms equal to 1e-5 relative, and the parameters equal up to
rounding. For bf16/fp16 gradients torch's reference norm is taken on float32
copies of its unscaled gradients (torch itself reduces them in bf16/fp16, see
test_total_norm.py) and applied with torch's ``clip_grads_with_norm_``.
"""

from __future__ import annotations

import itertools
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from tolerances import clipped_grad_rtol, norm_rtol
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchFSDPScaler

from shardscale.clip import unscale_and_clip_
from shardscale.core import Handle, LocalBackend, ReduceOp, ShardedGradScaler
from shardscale.core.plugins import CompletedHandle
from shardscale.core.step import VectorLayout
from shardscale.core.testing import recording_steps

POISON = {2: math.inf, 5: math.nan}
STEPS = 9


@pytest.fixture(scope="module", autouse=True)
def _world_of_one() -> Iterator[None]:
    """torch's fp16-capable scaler (FSDP1's) needs a process group, even alone."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


class TallyBackend(LocalBackend):
    """The local backend, counting its reductions (the thing under test is not mocked)."""

    name: ClassVar[str] = "tally"

    def __init__(self) -> None:
        self.calls: list[tuple[int, ReduceOp]] = []

    def all_reduce(self, tensor: torch.Tensor, *, op: ReduceOp, group: Any) -> Handle:
        self.calls.append((tensor.numel(), op))
        super().all_reduce(tensor, op=op, group=group)
        return CompletedHandle()


def make_model(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 4),
    ).to(dtype)


def batches(n: int, dtype: torch.dtype, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Growing inputs spread the gradient norms, so a max_norm between them clips only some steps.
    return [torch.randn(8, 12, generator=gen).to(dtype) * (0.5 + i) for i in range(n)]


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_foreach": lambda p: torch.optim.SGD(p, lr=0.05, foreach=True),
    "sgd_momentum_loop": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-3, fused=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, eps=1e-3, fused=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, fused=True),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-3, foreach=True),
}
SCALER_KW: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 3}


def torch_scaler(dtype: torch.dtype) -> Any:
    if dtype is torch.float16:  # torch.amp.GradScaler refuses fp16 gradients
        return TorchFSDPScaler("cpu", process_group=dist.group.WORLD, **SCALER_KW)
    return torch.amp.GradScaler("cpu", **SCALER_KW)


def torch_clip(model: torch.nn.Module, max_norm: float, p: float, dtype: torch.dtype) -> float:
    params = [q for q in model.parameters() if q.grad is not None]
    if dtype in (torch.float32, torch.float64):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, p))
    norm = torch.nn.utils.get_total_norm([q.grad.float() for q in params], p)  # type: ignore[union-attr]
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    data: list[torch.Tensor],
    clip: Callable[[], float],
    scaler: Any,
) -> tuple[list[float], list[float]]:
    norms, scales = [], []
    for step, x in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().pow(2).mean()
        if step in POISON:
            loss = loss * POISON[step]
        scaler.scale(loss).backward()
        norms.append(clip())
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return norms, scales


def run_pair(
    dtype: torch.dtype, opt_name: str, max_norm: float, p: float, **our_kw: Any
) -> tuple[Any, ...]:
    data = batches(STEPS, dtype)
    ref_model, our_model = make_model(dtype), make_model(dtype)
    ref_opt = OPTIMIZERS[opt_name](ref_model.parameters())
    our_opt = OPTIMIZERS[opt_name](our_model.parameters())
    ref_scaler = torch_scaler(dtype)

    def ref_clip() -> float:
        ref_scaler.unscale_(ref_opt)
        return torch_clip(ref_model, max_norm, p, dtype)

    ref_norms, ref_scales = train(ref_model, ref_opt, data, ref_clip, ref_scaler)
    if dtype is not torch.float32:
        # In float32 the step runs through torch's fused kernel (default): parity within the
        # bounds below. In bf16/fp16 the kernel computes the update in float32 without rounding
        # the unscaled gradient first, so parameters drift from torch's by ulps that feed back
        # through later gradients: the multiply path is compared here, the kernel's one step
        # in test_fused_optimizer.
        our_kw.setdefault("fuse_optimizer", False)
    ours = ShardedGradScaler("cpu", backend=our_kw.pop("backend", "local"), **SCALER_KW)
    returned: list[torch.Tensor] = []
    exact: list[float] = []

    def our_clip() -> float:
        # torch's norm of exactly the gradients we are about to clip (float64, unscaled).
        grads = [q.grad.double() for q in our_model.parameters() if q.grad is not None]
        exact.append(float(torch.nn.utils.get_total_norm(grads, p)) / ours.get_scale())
        returned.append(unscale_and_clip_(ours, our_opt, max_norm, p, **our_kw))
        return float(returned[-1])

    our_norms, our_scales = train(our_model, our_opt, data, our_clip, ours)
    # Parameters drift apart by rounding within a few steps (one ulp in low precision, less in
    # float32), which changes later gradients: each norm is compared with torch's float64 norm
    # of the very same gradients; the trained parameters are compared separately.
    ref_norms = exact
    return ref_model, our_model, ref_norms, our_norms, ref_scales, our_scales, returned


def numel() -> int:
    return sum(q.numel() for q in make_model(torch.float32).parameters())


def norm_bound(p: float, dtype: torch.dtype = torch.float32) -> float:
    """Two computed norms of the model's gradients differ by at most this (relative)."""
    return 2 * norm_rtol(numel(), dtype, p)


def param_bound(p: float, steps: int = STEPS) -> float:
    """float32 parameters after ``steps`` clipped steps: each step's gradient may differ by
    the clipped-gradient bound, and the differences add up over the steps."""
    return 2 * steps * clipped_grad_rtol(numel(), torch.float32, p)


def assert_norms_match(ref: list[float], ours: list[float], p: float = 2.0) -> None:
    for step, (r, o) in enumerate(zip(ref, ours, strict=True)):
        if step in POISON:
            assert not math.isfinite(o), f"step {step}: overflow must give a non-finite norm"
        else:
            assert math.isfinite(r)
            bound = norm_bound(p)
            assert abs(o - r) <= bound * abs(r), f"step {step}: norm {o} vs torch {r}"


def assert_params_close(a: torch.nn.Module, b: torch.nn.Module, rtol: float, atol: float) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.isfinite(pb).all(), f"{name} has non-finite values"
        torch.testing.assert_close(pb, pa, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def _cases() -> list[Any]:
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for opt_name in OPTIMIZERS:
            # torch's fp16-capable scaler crashes on fused optimizers after unscale_.
            if dtype is torch.float16 and "fused" in opt_name:
                continue
            cases.append(pytest.param(dtype, opt_name, id=f"{dtype}-{opt_name}"))
    return cases


@pytest.mark.parametrize(("dtype", "opt_name"), _cases())
@pytest.mark.parametrize("p", [2.0, 1.0, math.inf, 3.0])
def test_training_matches_torch(dtype: torch.dtype, opt_name: str, p: float) -> None:
    # max_norm is the median norm of an unclipped torch run: some steps clip, some do not.
    free = run_pair(dtype, opt_name, math.inf, p)[2]
    limit = sorted(n for i, n in enumerate(free) if i not in POISON)[(STEPS - len(POISON)) // 2]
    ref, ours, ref_norms, our_norms, ref_scales, our_scales, _ = run_pair(dtype, opt_name, limit, p)
    assert our_scales == ref_scales
    moves = list(itertools.pairwise(our_scales))
    assert any(b < a for a, b in moves) and any(b > a for a, b in moves)
    assert_norms_match(ref_norms, our_norms, p)
    finite = [n for i, n in enumerate(ref_norms) if i not in POISON]
    assert min(finite) < limit < max(finite), (
        "the case must exercise both clipped and unclipped steps"
    )
    if dtype is torch.float32:
        # Same arithmetic up to the order of float32 roundings in the norm and the coefficient.
        assert_params_close(ref, ours, rtol=param_bound(p), atol=param_bound(p))
    else:
        eps = torch.finfo(dtype).eps
        assert_params_close(ref, ours, rtol=4 * eps, atol=4 * eps)


def test_fp32_unclipped_sgd_is_bit_identical_to_torch() -> None:
    """With a power-of-two scale and no clipping, g * (1/s) equals torch's unscale exactly."""
    ref, ours, *_ = run_pair(torch.float32, "sgd_foreach", 1e9, 2.0)
    for pa, pb in zip(ref.parameters(), ours.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_one_collective_per_step_carrying_norm_and_overflow() -> None:
    # One SUM all-reduce per step of the engine's vector: 5 slots per rank (peak, power sum, chain,
    # non-finite count, error code) and the shared nan count; world size 1 here.
    backend = TallyBackend()
    *_, _returned = run_pair(torch.float32, "adam_fused", 1.0, 2.0, backend=backend)
    assert backend.calls == [(VectorLayout(1).size, ReduceOp.SUM)] * STEPS
    backend = TallyBackend()
    run_pair(torch.float32, "sgd_foreach", 1.0, math.inf, backend=backend)
    assert backend.calls == [(VectorLayout(1).size, ReduceOp.SUM)] * STEPS


def test_result_is_a_plain_float32_tensor_on_the_scale_device() -> None:
    *_, returned = run_pair(torch.bfloat16, "sgd_foreach", 1.0, 2.0)
    for norm in returned:
        assert type(norm) is torch.Tensor and norm.dtype is torch.float32 and norm.dim() == 0


def _step_once(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    scaler: ShardedGradScaler,
    poison: float = 1.0,
) -> None:
    opt.zero_grad(set_to_none=True)
    scaler.scale(model(batches(1, torch.float32)[0]).pow(2).mean() * poison).backward()


def test_fused_optimizer_gets_grad_scale_and_keeps_scaled_grads() -> None:
    model = make_model(torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    scaler = ShardedGradScaler("cpu", backend="local", init_scale=256.0)
    _step_once(model, opt, scaler)
    before = [q.grad.clone() for q in model.parameters()]  # type: ignore[union-attr]
    norm = unscale_and_clip_(scaler, opt, 0.01)
    # Nothing was multiplied: the optimizer divides by grad_scale = scale / coef itself.
    for q, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(q.grad, b)  # type: ignore[arg-type]
    exact = torch.linalg.vector_norm(torch.cat([b.flatten() for b in before]).double()) / 256.0
    assert abs(float(norm) - float(exact)) <= norm_bound(2.0) * float(exact)
    seen: dict[str, torch.Tensor] = {}
    original = opt.step

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen["grad_scale"] = opt.grad_scale.clone()  # type: ignore[attr-defined]
        seen["found_inf"] = opt.found_inf.clone()  # type: ignore[attr-defined]
        return original(*args, **kwargs)

    opt.step = spy  # type: ignore[method-assign]
    scaler.step(opt)
    coef = 0.01 / (float(exact) + 1e-6)
    tol = 2 * clipped_grad_rtol(numel(), torch.float32, 2.0)  # the coefficient's error
    assert abs(float(seen["grad_scale"]) - 256.0 / coef) <= tol * 256.0 / coef
    assert float(seen["found_inf"]) == 0.0


def test_overflow_skips_fused_step_and_reports_nonfinite_norm() -> None:
    model = make_model(torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    scaler = ShardedGradScaler("cpu", backend="local", init_scale=256.0)
    weights = [q.detach().clone() for q in model.parameters()]
    _step_once(model, opt, scaler, poison=math.inf)
    norm = unscale_and_clip_(scaler, opt, 1.0)
    assert not torch.isfinite(norm)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 128.0
    for q, w in zip(model.parameters(), weights, strict=True):
        assert torch.equal(q, w)
    assert all(float(s["step"]) == 0 for s in opt.state.values())


def test_observers_receive_the_norm() -> None:
    with recording_steps() as recorder:
        model = make_model(torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ShardedGradScaler("cpu", backend="local")
        _step_once(model, opt, scaler)
        norm = unscale_and_clip_(scaler, opt, 1.0)
        scaler.step(opt)
        scaler.update()
    assert len(recorder.records) == 1
    assert recorder.records[0].grad_norm is not None
    assert torch.equal(recorder.records[0].grad_norm, norm)


def test_disabled_scaler_is_plain_clipping() -> None:
    model, ref = make_model(torch.float32), make_model(torch.float32)
    x = batches(1, torch.float32)[0]
    for m in (model, ref):
        m(x).pow(2).mean().backward()
    scaler = ShardedGradScaler("cpu", enabled=False, backend="local")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norm = unscale_and_clip_(scaler, opt, 0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert abs(float(norm) - float(ref_norm)) <= norm_bound(2.0) * float(ref_norm)
    tol = 2 * clipped_grad_rtol(numel(), torch.float32, 2.0)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=0)


def test_foreach_false_uses_the_loop_kernels_with_the_same_result() -> None:
    results = []
    for foreach in (None, False):
        _ref, ours, ref_norms, our_norms, _ref_scales, _our_scales, _ = run_pair(
            torch.float32, "sgd_foreach", 1.5, 2.0, foreach=foreach
        )
        assert_norms_match(ref_norms, our_norms)
        results.append([q.detach().clone() for q in ours.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=param_bound(2.0), atol=param_bound(2.0))


def test_frozen_parameters_and_several_param_groups() -> None:
    results = []
    for use_ours in (False, True):
        model = make_model(torch.float32)
        layers = [m for m in model if isinstance(m, torch.nn.Linear)]
        layers[1].weight.requires_grad_(False)
        opt = torch.optim.SGD(
            [{"params": layers[0].parameters()}, {"params": layers[2].parameters(), "lr": 0.01}],
            lr=0.1,
        )
        scaler: Any = (
            ShardedGradScaler("cpu", backend="local") if use_ours else torch.amp.GradScaler("cpu")
        )
        for x in batches(4, torch.float32):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            if use_ours:
                unscale_and_clip_(scaler, opt, 0.5)
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(
                    [q for g in opt.param_groups for q in g["params"]], 0.5
                )
            scaler.step(opt)
            scaler.update()
        results.append([q.detach().clone() for q in model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=param_bound(2.0, 4), atol=param_bound(2.0, 4))
