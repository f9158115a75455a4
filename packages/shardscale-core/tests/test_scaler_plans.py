"""The step plans a scaler keeps: per optimizer, alive only with it, and no obstacle to swap_tensors.

torch's ``swap_tensors`` (what ``module.to()`` does under
``torch.__future__.set_swap_module_params_on_conversion(True)``, and always for
DTensor parameters) refuses a tensor that has a weak reference. A scaler that
kept weak references to parameters or gradients would make a model unmovable
after its first step; torch's GradScaler keeps none. Each case runs the same
loop with torch's scaler in the same process.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from shardscale.core import ShardedGradScaler

SCALE = 2.0**10  # a power of two: unscaling is exact, so both scalers' parameters match bitwise


@pytest.fixture
def swap_on_conversion() -> Iterator[None]:
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def _train(
    scaler: ShardedGradScaler | torch.amp.GradScaler, *, clip: bool, inf_at: int
) -> tuple[torch.nn.Sequential, list[float], list[str]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales, reports = [], []
    for step in range(4):
        x = torch.arange(6.0).reshape(2, 3) / (step + 1)
        scaler.scale(model(x).square().sum()).backward()
        if step == inf_at:
            grad = model[1].weight.grad
            assert grad is not None
            grad[0, 0] = float("inf")
        if clip and isinstance(scaler, ShardedGradScaler):
            scaler.unscale_(opt, max_norm=1.0)
        else:
            scaler.unscale_(opt)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()  # the gradients are gone before anyone asks for the report
        if step == inf_at and isinstance(scaler, ShardedGradScaler):
            reports.append(str(scaler.overflow_report(module=model)))
        scales.append(float(scaler.get_scale()))
        # Every parameter swapped twice (float32 -> float64 -> float32 is exact).
        model.to(torch.float64).to(torch.float32)
    return model, scales, reports


@pytest.mark.usefixtures("swap_on_conversion")
@pytest.mark.parametrize("clip", [False, True], ids=["unscale", "unscale-and-clip"])
def test_a_model_moves_between_steps_as_with_torch(clip: bool) -> None:
    ours, our_scales, reports = _train(
        ShardedGradScaler("cpu", init_scale=SCALE), clip=clip, inf_at=1
    )
    theirs, their_scales, _ = _train(
        torch.amp.GradScaler("cpu", init_scale=SCALE), clip=clip, inf_at=1
    )
    assert our_scales == their_scales == [SCALE, SCALE / 2, SCALE / 2, SCALE / 2]
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert a.dtype == b.dtype == torch.float32
        if not clip:  # the unscale by a power of two is exact: the same SGD steps, bit for bit
            assert torch.equal(a, b)
        else:
            # The clip coefficient differs in the norm's float32 summation order (26 squares in
            # per-tensor partial sums vs one sum): (26 + 4)·u relative per step, u = 2**-24, and
            # it scales one SGD update of magnitude <= lr·max_norm = 0.1 per step, 3 steps taken.
            u = torch.finfo(torch.float32).eps / 2
            torch.testing.assert_close(a, b, rtol=4 * u, atol=3 * 0.1 * 30 * u)
    # Named although zero_grad freed the gradient: the skipped step() noted it.
    (report,) = reports
    assert "skipped (overflow)" in report and "rank 0: 1.weight" in report, report


def test_the_plans_of_an_optimizer_go_with_it() -> None:
    scaler = ShardedGradScaler("cpu", init_scale=SCALE)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        scaler.scale(model(torch.ones(2, 3)).sum()).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    uses = [[plan.uses for plan in plans] for plans in scaler._plans.values()]
    assert uses == [[2]]  # one plan, built on the first step and reused on the next two
    params = [weakref.ref(p) for p in model.parameters()]
    grads = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
    opt.zero_grad()
    gc.collect()
    assert len(grads) == 4 and all(g() is None for g in grads)  # the kept iteration let go
    del model, opt
    gc.collect()
    assert all(p() is None for p in params)  # the scaler lives on; the parameters do not
    assert not scaler._plans


def test_clip_grad_norm_keeps_the_plan_of_its_last_call_only() -> None:
    scaler = ShardedGradScaler("cpu", init_scale=SCALE)
    first, second = _model(), _model()
    for model in (first, second):
        model(torch.ones(2, 3)).sum().backward()
    want = torch.nn.utils.clip_grad_norm_(list(_grads_copy(first)), 0.5)
    got = scaler.clip_grad_norm_(first.parameters(), 0.5)
    # float32: 26 squares summed per tensor then across 4 tensors, vs torch's own order.
    u = torch.finfo(torch.float32).eps / 2
    torch.testing.assert_close(got, want, rtol=(26 + 4) * u, atol=0.0)
    first_params = [weakref.ref(p) for p in first.parameters()]
    scaler.clip_grad_norm_(second.parameters(), 0.5)
    del first
    gc.collect()
    assert all(p() is None for p in first_params)  # the second call's plan replaced the first's
    scaler.clip_grad_norm_(second.parameters(), 0.5)
    assert [plan.uses for plan in scaler._clip_plans] == [1]


def _grads_copy(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    for p in model.parameters():
        q = torch.nn.Parameter(p.detach().clone())
        assert p.grad is not None
        q.grad = p.grad.clone()
        yield q
