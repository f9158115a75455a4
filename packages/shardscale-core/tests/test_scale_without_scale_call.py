"""A scaler that never calls ``scale()`` (a pipeline stage without the loss) still steps.

In a pipeline only the last stage scales the loss; the other stages receive
gradients that already carry the scale. Their scaler must unscale by the same
number, skip on the same steps and move its scale the same way. Here two
scalers in one process stand for two stages: one scales the loss, the other
never does but its gradients carry the same factor. torch's GradScaler raises
on the second (checked below, so a change in torch shows up here).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from shardscale.core import Layout, ShardedGradScaler

KW = {"init_scale": 2.0**8, "growth_interval": 2, "backend": "local"}


def _stages() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(4, 6), nn.Linear(6, 1)


def test_torch_grad_scaler_refuses_a_stage_that_never_scaled() -> None:
    first, _ = _stages()
    first(torch.randn(3, 4)).sum().backward()
    opt = torch.optim.SGD(first.parameters(), lr=0.1)
    with pytest.raises(AssertionError, match="None"):
        torch.amp.GradScaler("cpu").step(opt)


@pytest.mark.parametrize("how", ["step", "unscale_", "clip"])
def test_first_stage_matches_a_scaler_that_scaled(how: str) -> None:
    """The stage without scale() gets the same scales, skips and parameters as one scaler."""
    first, last = _stages()
    ref_first, ref_last = copy.deepcopy(first), copy.deepcopy(last)
    opt_a = torch.optim.SGD(first.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(last.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD([*ref_first.parameters(), *ref_last.parameters()], lr=0.1)
    stage_a = ShardedGradScaler("cpu", **KW)  # never scales anything
    stage_b = ShardedGradScaler("cpu", **KW)  # scales the loss
    ref = torch.amp.GradScaler("cpu", init_scale=KW["init_scale"], growth_interval=2)
    for step in range(6):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        poison = math.inf if step == 2 else 1.0
        # The pipeline: stage a's output is detached and sent; b's input grad is sent back.
        h = first(x)
        h_recv = h.detach().requires_grad_()
        loss = last(h_recv).pow(2).mean() * poison
        stage_b.scale(loss).backward()
        assert h_recv.grad is not None
        h.backward(h_recv.grad)
        ref.scale(ref_last(ref_first(x)).pow(2).mean() * poison).backward()
        for scaler, opt in ((stage_a, opt_a), (stage_b, opt_b)):
            if how == "unscale_":
                scaler.unscale_(opt)
            elif how == "clip":
                # The scaler's own clip (what shardscale.clip.unscale_and_clip_ fronts): core's
                # tests run with core alone in the isolated session.
                scaler.unscale_(opt, max_norm=math.inf)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        ref.step(ref_opt)
        ref.update()
        ref_opt.zero_grad()
        assert stage_a.get_scale() == stage_b.get_scale() == ref.get_scale(), step
        assert bool(stage_a.last_step_skipped) == (step == 2)
    ours = [*first.parameters(), *last.parameters()]
    # Same arithmetic in the same order (unscale by the float32 1/scale, then SGD): bit-equal.
    for a, b in zip(ours, [*ref_first.parameters(), *ref_last.parameters()], strict=True):
        assert torch.equal(a, b)


def test_scale_created_at_step_is_init_scale_and_checkpoints() -> None:
    model, _ = _stages()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", **{**KW, "init_scale": 512.0})
    assert scaler.state_dict()["scale"] == 512.0
    model(torch.randn(2, 4)).sum().backward()
    scaler.step(opt)
    scale = scaler._get_scale_async()
    assert scale is not None and scale.device.type == "cpu" and scale.dtype is torch.float32
    assert float(scale) == 512.0
    scaler.update()
    assert scaler.state_dict()["_growth_tracker"] == 1
    other = ShardedGradScaler("cpu", **KW)
    other.load_state_dict(scaler.state_dict())
    assert other.get_scale() == 512.0
    # A loaded scaler that never scales starts from the loaded scale, not its own init_scale.
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    other.step(opt)
    other.update()
    assert other.get_scale() == 1024.0  # interval 2 completed: grown once


def test_update_without_any_step_still_refuses() -> None:
    with pytest.raises(AssertionError, match="before the scale exists"):
        ShardedGradScaler("cpu", **KW).update()


def test_distinct_params_follow_a_copy_of_model_and_scaler() -> None:
    """A deep copy of (model, scaler) declares the copied parameters, not the originals."""
    model, _ = _stages()
    scaler = ShardedGradScaler("cpu", layout=Layout(distinct_params=iter([model.weight])), **KW)
    assert scaler.step_config.distinct_params == {id(model.weight)}
    model2, scaler2 = copy.deepcopy((model, scaler))
    assert scaler2.step_config.distinct_params == {id(model2.weight)}
