"""A third-party skip policy from an installed distribution, on 2 gloo ranks.

``shardscale-example-policy`` (integration_tests/plugins/) registers
``LossMedianSkip`` through the ``shardscale`` entry point: skip a step whose
loss exceeds k x the median of the accepted losses. Both ranks train the same
plain model on the same data (so their parameters stay identical) with
``ShardedGradScaler(policies=[LossMedianSkip(k=3.0)])``; at one known step
rank 1 alone observes a loss 50x larger. Both ranks skip exactly that step,
for the plugin's reason code, and end with the parameters of a hand-written
torch loop that skips that step; every step is still one all-reduce with no
host read. A checkpoint round trip keeps the plugin's window.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

STEPS = 10
# fused=True on both sides: the fused kernel takes found_inf on the device (an unfused
# step reads it on the host, as torch does), and the reference uses the same kernel.
SPIKE_STEP = 7
SPIKE_RANK = 1
LR = 0.05


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch() -> torch.Tensor:
    # One fixed batch: the loss drifts slowly, far from 3x its median (no natural skip).
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(1))


def _reference() -> list[torch.Tensor]:
    """torch alone: SGD on every step but SPIKE_STEP (what the policy must skip)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, fused=True)
    x = _batch()
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        if step != SPIKE_STEP:
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _plugin_case() -> dict[str, Any]:
    from shardscale_example_policy import LossMedianSkip

    from shardscale.core import ShardedGradScaler, get_registry
    from shardscale.core.testing import CountingGlooGroup, HostReadRecorder, counting_gloo_group

    rank = dist.get_rank()
    registered = get_registry().policy_class("loss_median")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, fused=True)
    group = counting_gloo_group()

    def new_scaler() -> ShardedGradScaler:
        return ShardedGradScaler(
            "cpu",
            backend="c10d",
            process_group=group,
            loss_scaling=False,
            policies=[LossMedianSkip(k=3.0, window=8, warmup=3)],
        )

    scaler = new_scaler()
    x = _batch()
    out: dict[str, Any] = {"seen": [], "calls": [], "reasons": [], "registered": registered}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        if step == SPIKE_STEP and rank == SPIKE_RANK:
            loss = loss * 50.0  # this rank's loss (and its gradients) spike
        scaler.scale(loss).backward()
        detector = HostReadRecorder()
        before = CountingGlooGroup.calls
        with detector:
            scaler.step(opt)
            scaler.update()
        out["calls"].append(CountingGlooGroup.calls - before)
        out["seen"].append(detector.seen)
        out["reasons"].append(int(scaler.last_skip_reason))  # type: ignore[arg-type]
    out["params"] = [p.detach().clone() for p in model.parameters()]
    saved = scaler.state_dict()
    out["saved"] = saved["policy.loss_median"]
    # A new scaler loads the window before its first step, and keeps it once bound.
    resumed = new_scaler()
    resumed.load_state_dict(saved)
    out["loaded"] = resumed.state_dict()["policy.loss_median"]
    opt.zero_grad(set_to_none=True)
    spike = model(x).pow(2).mean() * (50.0 if rank == SPIKE_RANK else 1.0)
    resumed.scale(spike).backward()
    resumed.step(opt)
    resumed.update()
    # The window was armed by the checkpoint: the very first step's spike is caught.
    out["resumed_reason"] = int(resumed.last_skip_reason)  # type: ignore[arg-type]
    out["resumed"] = resumed.state_dict()["policy.loss_median"]
    return out


def test_plugin_policy_skips_one_step_on_every_rank(pool2: Pool) -> None:
    from shardscale_example_policy import LossMedianSkip

    results = pool2.run(_plugin_case, timeout=120)
    expected = _reference()
    for res in results:
        assert isinstance(res, dict)
        assert res["registered"] is LossMedianSkip
        # The first step also checks the backend chain once (one small all-reduce beside it).
        assert res["calls"] == [2] + [1] * (STEPS - 1), res["calls"]
        # The chain check reads its result once, by design; every later step reads nothing.
        assert res["seen"][1:] == [[]] * (STEPS - 1), res["seen"]
        assert res["reasons"] == [
            LossMedianSkip.code if s == SPIKE_STEP else 0 for s in range(STEPS)
        ], res["reasons"]
        for ours, ref in zip(res["params"], expected, strict=True):
            # The same torch ops on the same values in the same order: bitwise equal.
            assert torch.equal(ours, ref)
        # The window holds the accepted steps' losses only (STEPS - 1 of them, window 8).
        assert res["saved"]["accepted"] == STEPS - 1
        assert len(res["saved"]["losses"]) == 8
        assert res["loaded"] == res["saved"]
        assert res["resumed_reason"] == LossMedianSkip.code
        assert res["resumed"] == res["saved"]  # a skipped step adds nothing
    first, second = results
    assert isinstance(first, dict) and isinstance(second, dict)
    assert first["saved"] == second["saved"]


def test_plugin_policy_is_listed_and_refused_when_malformed() -> None:
    from shardscale_example_policy import LossMedianSkip

    from shardscale.core import ShardedGradScaler, get_registry

    registry = get_registry()
    assert registry.skip_policies()["loss_median"] is LossMedianSkip
    from shardscale.core import SpikeSkip

    assert registry.skip_policies()["spike"] is SpikeSkip
    listed = {(i.name, i.kind, i.distribution) for i in registry.items()}
    assert ("loss_median", "policy", "shardscale-example-policy") in listed
    with pytest.raises(ValueError, match=r"k=0.5.*\(1, 1000\]"):
        LossMedianSkip(k=0.5)
    with pytest.raises(ValueError, match=r"window=100000.*1\.\.4096"):
        LossMedianSkip(window=100_000)
    with pytest.raises(TypeError, match="policy objects, got the class"):
        ShardedGradScaler("cpu", policies=[LossMedianSkip])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="share the name 'loss_median'"):
        ShardedGradScaler("cpu", policies=[LossMedianSkip(), LossMedianSkip(k=2.0)])


def _different_policies_case() -> dict[str, Any]:
    from shardscale_example_policy import LossMedianSkip

    from shardscale.core import ShardedGradScaler

    rank = dist.get_rank()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = ShardedGradScaler(
        "cpu",
        backend="c10d",
        loss_scaling=False,
        # One k per rank: on the same losses one rank would skip while the other steps.
        policies=[LossMedianSkip(k=3.0 if rank == 0 else 4.0)],
    )
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(_batch()).pow(2).mean()).backward()
    try:
        scaler.step(opt)
    except Exception as exc:
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        return {"error": type(exc).__name__, "text": str(exc), "unchanged": unchanged}
    return {"error": None}


def test_ranks_with_different_policies_all_raise(pool2: Pool) -> None:
    for rank, res in enumerate(pool2.run(_different_policies_case, timeout=60)):
        assert isinstance(res, dict)
        assert res["error"] == "DeclarationError", res
        # Each rank names its own policy (compare the messages across ranks).
        assert f"policies=[loss_median:k={3.0 if rank == 0 else 4.0}" in res["text"], res["text"]
        assert res["unchanged"], res
