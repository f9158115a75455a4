"""Skip policies as plugins, in one process: validation, precedence, found_inf, registry, state.

The policy here is a real one written against the public protocol: a rank
votes when its observed loss is above ``limit`` (one SUM slot), and the step is
skipped when any rank voted. Its state counts the steps it skipped.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from shardscale.core import (
    LossCheck,
    PluginConflictError,
    PolicyState,
    Registry,
    ShardedGradScaler,
    SkipPolicy,
    SkipReason,
    SkipStreakLimit,
    SpikeSkip,
    hookimpl,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class LossAbove:
    name: ClassVar[str] = "loss_above"
    code: ClassVar[int] = 40
    precedence: ClassVar[int] = 12
    slots: ClassVar[tuple[str, ...]] = ("votes",)

    limit: float = 10.0

    def fingerprint(self) -> str:
        return f"limit={self.limit!r}"

    def bind(self, device: torch.device) -> _LossAboveState:
        return _LossAboveState(self, device)


class _LossAboveState:
    def __init__(self, policy: LossAbove, device: torch.device) -> None:
        self.policy = policy
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)

    def fill(self, out: Mapping[str, torch.Tensor], *, loss: torch.Tensor | None) -> None:
        if loss is None:
            out["votes"].zero_()
        else:
            torch.gt(loss, self.policy.limit, out=out["votes"])

    def flag(
        self,
        reduced: Mapping[str, torch.Tensor],
        *,
        norm: torch.Tensor | None,
        found_inf: torch.Tensor,
        loss: torch.Tensor | None,
    ) -> torch.Tensor:
        return reduced["votes"] > 0

    def after_update(self, reason: torch.Tensor) -> None:
        self.skipped.add_(reason == self.policy.code)

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": int(self.skipped.item())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        value = state.get("skipped")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"policy.loss_above 'skipped' must be an int >= 0, got {value!r}")
        self.skipped.fill_(value)


def test_the_example_satisfies_the_protocols() -> None:
    policy = LossAbove()
    assert isinstance(policy, SkipPolicy)
    assert isinstance(policy.bind(torch.device("cpu")), PolicyState)


def _train(
    scaler: ShardedGradScaler, losses: Sequence[float], *, nan_grad_at: int | None = None
) -> tuple[list[int], list[float], torch.nn.Linear]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reasons, scales = [], []
    for step, factor in enumerate(losses):
        opt.zero_grad(set_to_none=True)
        loss = model(torch.ones(2, 3)).pow(2).mean() * 0.0 + factor
        scaler.scale(loss).backward()
        if step == nan_grad_at:
            assert model.weight.grad is not None
            model.weight.grad[0, 0] = math.nan
        scaler.step(opt)
        scaler.update()
        reasons.append(int(scaler.last_skip_reason))  # type: ignore[arg-type]
        scales.append(scaler.get_scale())
    return reasons, scales, model


def test_a_policy_skips_with_its_code_and_leaves_the_scale_alone() -> None:
    scaler = ShardedGradScaler("cpu", init_scale=4.0, policies=[LossAbove(limit=10.0)])
    reasons, scales, _ = _train(scaler, [1.0, 20.0, 1.0])
    assert reasons == [0, LossAbove.code, 0]
    assert scales == [4.0, 4.0, 4.0]  # only a non-finite gradient backs the scale off
    assert scaler.state_dict()["policy.loss_above"] == {"skipped": 1}


def test_precedence_over_spike_and_under_loss_and_overflow() -> None:
    # A non-finite gradient (overflow, precedence 40) beats the policy (15); the scale backs off.
    scaler = ShardedGradScaler("cpu", init_scale=4.0, policies=[LossAbove(limit=10.0)])
    reasons, scales, _ = _train(scaler, [20.0], nan_grad_at=0)
    assert reasons == [SkipReason.OVERFLOW] and scales == [2.0]
    # A non-finite loss (20) beats it too.
    scaler = ShardedGradScaler(
        "cpu", loss_scaling=False, policies=[LossCheck(), LossAbove(limit=10.0)]
    )
    reasons, _, _ = _train(scaler, [math.inf])
    assert reasons == [SkipReason.LOSS]
    # It beats a spike (10): an absolute norm threshold every step exceeds.
    scaler = ShardedGradScaler(
        "cpu",
        loss_scaling=False,
        policies=[SpikeSkip(max_norm_abs=1e-30, z=None), LossAbove(limit=10.0)],
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for loss_value, expected in ((1.0, SkipReason.SPIKE), (20.0, LossAbove.code)):
        opt.zero_grad(set_to_none=True)
        scaler.scale(model(torch.ones(2, 3)).pow(2).mean() + loss_value).backward()
        scaler.unscale_(opt, max_norm=1e9)
        scaler.step(opt)
        scaler.update()
        assert int(scaler.last_skip_reason) == expected  # type: ignore[arg-type]


def test_a_skipped_step_leaves_the_parameters_as_torch_would() -> None:
    scaler = ShardedGradScaler("cpu", loss_scaling=False, policies=[LossAbove(limit=10.0)])
    _, _, ours = _train(scaler, [1.0, 20.0, 1.0])
    torch.manual_seed(0)
    ref = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        (ref(torch.ones(2, 3)).pow(2).mean() * 0.0 + 1.0).backward()
        if step != 1:
            opt.step()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_checkpoint_round_trip_and_a_bad_state_changes_nothing() -> None:
    scaler = ShardedGradScaler("cpu", init_scale=8.0, policies=[LossAbove()])
    _train(scaler, [20.0, 20.0])
    saved = scaler.state_dict()
    fresh = ShardedGradScaler("cpu", policies=[LossAbove()])
    fresh.load_state_dict(saved)  # before the first step: held until bound
    assert fresh.state_dict()["policy.loss_above"] == {"skipped": 2}
    _train(fresh, [1.0])  # bound now, with the loaded count
    assert fresh.state_dict()["policy.loss_above"] == {"skipped": 2}
    bad = dict(saved, scale=2.0, **{"policy.loss_above": {"skipped": -1}})
    with pytest.raises(ValueError, match="'skipped' must be an int >= 0"):
        fresh.load_state_dict(bad)
    assert fresh.get_scale() == 8.0 and fresh.state_dict()["policy.loss_above"] == {"skipped": 2}
    unbound = ShardedGradScaler("cpu", policies=[LossAbove()])
    with pytest.raises(ValueError, match="'skipped' must be an int >= 0"):
        unbound.load_state_dict(bad)  # refused before the policy is bound, too
    assert "policy.loss_above" not in unbound.state_dict()
    copied = copy.deepcopy(fresh)  # the device state travels as the policy's state_dict
    assert copied.state_dict()["policy.loss_above"] == {"skipped": 2}
    _train(copied, [20.0])
    assert copied.state_dict()["policy.loss_above"] == {"skipped": 3}
    assert fresh.state_dict()["policy.loss_above"] == {"skipped": 2}


@pytest.mark.parametrize(
    ("policies", "error", "match"),
    [
        ("loss_above", TypeError, "takes a list of skip policies"),
        ([LossAbove], TypeError, "got the class LossAbove"),
        ([object()], TypeError, "policies holds a object"),
        ([LossAbove(), LossAbove(limit=3.0)], ValueError, "share the name 'loss_above'"),
    ],
)
def test_bad_policies_are_refused(policies: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ShardedGradScaler("cpu", policies=policies)


@pytest.mark.parametrize(
    ("attrs", "match"),
    [
        ({"code": 5}, r"'code' must be an int in 16\.\.62"),
        ({"code": 63}, r"'code' must be an int in 16\.\.62"),
        ({"precedence": 20}, r"'precedence' must be an int in 1\.\.29"),
        ({"precedence": 30}, r"'precedence' must be an int in 1\.\.29"),
        ({"slots": ["votes"]}, "'slots' must be a tuple"),
    ],
)
def test_declarations_out_of_range_are_refused(attrs: dict[str, Any], match: str) -> None:
    cls = type("Bad", (LossAbove,), attrs)
    with pytest.raises(ValueError, match=match):
        ShardedGradScaler("cpu", policies=[cls()])


def test_registry_lists_policies_and_names_both_owners_of_a_clash() -> None:
    registry = Registry()
    assert registry.skip_policies()["spike"] is SpikeSkip

    class Mine:
        @hookimpl
        def shardscale_skip_policies(self) -> list[type]:
            return [LossAbove]

    class Clash:
        @hookimpl
        def shardscale_skip_policies(self) -> list[type]:
            return [type("Other", (LossAbove,), {"name": "other"})]  # same code 40

    registry.register(Mine(), name="mine")
    try:
        assert registry.policy_class("loss_above") is LossAbove
        item = next(i for i in registry.items() if i.name == "loss_above")
        assert (item.kind, item.priority) == ("policy", LossAbove.precedence)
        registry.register(Clash(), name="clash")
        with pytest.raises(PluginConflictError, match=r"code 40.*'clash'.*'mine'|'mine'.*'clash'"):
            registry.skip_policies()
    finally:
        for name in ("mine", "clash"):
            if registry._pm.get_plugin(name) is not None:
                registry.unregister(name)


def test_several_optimizers_take_the_strongest_reason_by_precedence() -> None:
    # Optimizer A overflows (code 4, precedence 40); the policy flags both steps (code 40,
    # precedence 12): the iteration's reason is the overflow, not the larger code.
    scaler = ShardedGradScaler("cpu", init_scale=4.0, policies=[LossAbove(limit=10.0)])
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    x = torch.ones(2, 3)
    scaler.scale((a(x) + b(x)).pow(2).mean() * 0.0 + 20.0).backward()
    assert a.weight.grad is not None
    a.weight.grad[0, 0] = math.nan
    scaler.step(opt_a)
    scaler.step(opt_b)
    scaler.update()
    assert int(scaler.last_skip_reason) == SkipReason.OVERFLOW  # type: ignore[arg-type]
    assert scaler.get_scale() == 2.0


def test_a_streak_of_policy_skips_names_its_code() -> None:
    from shardscale.core import SkipStreakError

    scaler = ShardedGradScaler(
        "cpu", loss_scaling=False, policies=[SkipStreakLimit(max_skips=2), LossAbove(limit=10.0)]
    )
    with pytest.raises(SkipStreakError, match=r"reasons: code 40\)"):
        _train(scaler, [20.0, 20.0])
