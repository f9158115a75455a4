"""Iteration and step_and_flag: several optimizers, each flag its own, one update per iteration.

Compared in the same process with torch.amp.GradScaler driven by hand the way
torch documents several optimizers: step each, then one update().
"""

from __future__ import annotations

import pytest
import torch

from shardscale.core import ShardedGradScaler
from shardscale.core.scaler import Iteration, step_and_flag

INIT_SCALE = 2.0**10  # a power of two: unscaling is exact, so torch's parameters match bitwise


def _branches(fused: bool) -> tuple[list[torch.nn.Linear], list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    kw = {"fused": True} if fused else {}
    return [a, b], [torch.optim.Adam(m.parameters(), lr=0.1, **kw) for m in (a, b)]


def _backward(
    scaler: ShardedGradScaler | torch.amp.GradScaler,
    models: list[torch.nn.Linear],
    *,
    overflow_b: bool,
) -> None:
    x = torch.arange(6.0).reshape(2, 3) / 6
    loss = sum(m(x).square().sum() for m in models)
    scaler.scale(loss).backward()
    if overflow_b:
        grad = models[1].weight.grad
        assert grad is not None
        grad[0, 0] = float("inf")


def _params(models: list[torch.nn.Linear]) -> list[torch.Tensor]:
    return [p.detach().clone() for m in models for p in m.parameters()]


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_two_optimizers_one_overflowing_each_flag_and_one_backoff_like_torch(fused: bool) -> None:
    ours, our_opts = _branches(fused)
    theirs, their_opts = _branches(fused)
    scaler = ShardedGradScaler("cpu", init_scale=INIT_SCALE, growth_interval=1)
    reference = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=1)
    it = Iteration(scaler)
    before_b = _params(ours)[2:]
    for step, overflow_b in enumerate([True, False]):
        _backward(scaler, ours, overflow_b=overflow_b)
        _backward(reference, theirs, overflow_b=overflow_b)
        # A clip over everything unscales both before either steps (torch: once each).
        for our_opt, their_opt in zip(our_opts, their_opts, strict=True):
            if not fused:  # a fused optimizer unscales inside its step
                it.unscale_(our_opt)
                it.unscale_(our_opt)  # asked twice: unscaled once (the scaler would refuse)
                reference.unscale_(their_opt)
        assert it.due(our_opts)
        _, flag_a = it.step(our_opts[0])
        assert it.has_stepped(our_opts[0]) and not it.has_stepped(our_opts[1])
        assert it.due(our_opts)  # b still holds gradients and has not stepped
        _, flag_b = it.step(our_opts[1])
        assert not it.due(our_opts)
        for their_opt in their_opts:
            reference.step(their_opt)
        # Each optimizer's own decision, known before the update (a scheduler asks here).
        assert flag_a is not None and flag_b is not None
        assert not bool(flag_a) and bool(flag_b) is overflow_b
        flags = it.end()
        reference.update()
        assert flags == {id(our_opts[0]): flag_a, id(our_opts[1]): flag_b}
        assert it.stepped == {} and it.unscaled == set()
        # One update for the iteration: one backoff (x0.5) for one overflow, not one per optimizer.
        assert (
            scaler.get_scale()
            == reference.get_scale()
            == (INIT_SCALE * 0.5 if step == 0 else INIT_SCALE)
        )
        torch.testing.assert_close(_params(ours), _params(theirs), rtol=0, atol=0)
        if step == 0:
            torch.testing.assert_close(_params(ours)[2:], before_b, rtol=0, atol=0)  # b skipped
        for opt in our_opts + their_opts:
            opt.zero_grad()


def test_end_without_a_step_does_not_update() -> None:
    (model, _), (opt, _) = _branches(fused=False)
    scaler = ShardedGradScaler("cpu", init_scale=INIT_SCALE)
    it = Iteration(scaler)
    assert it.end() == {}  # update() now would refuse: no overflow checks this iteration
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    it.mark_unscaled(opt)
    assert it.unscaled == {id(opt)} and it.due([opt])
    assert it.end() == {} and scaler.get_scale() == INIT_SCALE


def test_a_disabled_scaler_records_no_unscale_and_steps_plainly() -> None:
    (model, _), (opt, _) = _branches(fused=False)
    scaler = ShardedGradScaler("cpu", enabled=False)
    it = Iteration(scaler)
    model(torch.ones(1, 3)).sum().backward()
    it.mark_unscaled(opt)
    it.unscale_(opt)
    assert it.unscaled == set()
    before = _params([model])
    _, flag = it.step(opt)
    assert flag is not None and not bool(flag)
    assert not torch.equal(_params([model])[0], before[0])  # it stepped
    assert set(it.end()) == {id(opt)}


def test_step_and_flag_of_an_optimizer_without_step_hooks_is_unknown() -> None:
    class Bare:
        """An optimizer-like object without register_step_pre_hook (apex-style)."""

        def __init__(self, opt: torch.optim.Optimizer) -> None:
            self.opt = opt
            self.param_groups = opt.param_groups
            self.state = opt.state

        def step(self) -> None:
            self.opt.step()

    (model, _), (opt, _) = _branches(fused=False)
    scaler = ShardedGradScaler("cpu", init_scale=INIT_SCALE)
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    _, flag = step_and_flag(scaler, Bare(opt))  # type: ignore[arg-type]
    assert flag is None
    scaler.update()
    assert scaler.last_step_skipped is not None and not bool(scaler.last_step_skipped)
