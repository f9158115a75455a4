"""use_shardscale in one process: Accelerate's contract, bad input, a real loop, checkpoints.

The 2-rank DDP (MULTI_CPU) runs with injected overflow are in
integration_tests/test_accelerate.py.
"""

from __future__ import annotations

import importlib.metadata as md
import inspect
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import accelerate
import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import GradScalerKwargs
from packaging.requirements import Requirement

from shardscale.accelerate import (
    TESTED_ACCELERATE,
    AccelerateContractError,
    ShardscaleAcceleratedOptimizer,
    ShardscaleAcceleratedScheduler,
    check_accelerate,
    contract_problems,
    is_using_shardscale,
    use_shardscale,
)
from shardscale.core import Registry, ShardedGradScaler
from shardscale.core.testing import HostReadRecorder, RecordingKernels


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    # Accelerate keeps process-wide singletons: every test starts and ends without them.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _accelerator(**kw: Any) -> Accelerator:
    kw.setdefault("mixed_precision", "fp16")
    return Accelerator(cpu=True, **kw)


# -- the contract with Accelerate -------------------------------------------------------------


def test_installed_accelerate_is_the_tested_one_and_in_range() -> None:
    reqs = [Requirement(r) for r in md.requires("shardscale-accelerate") or []]
    (spec,) = [r.specifier for r in reqs if r.name == "accelerate"]
    assert accelerate.__version__ in spec
    assert TESTED_ACCELERATE in spec


def test_the_installed_accelerate_meets_the_contract() -> None:
    assert contract_problems(_accelerator()) == []


def test_a_changed_signature_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    def clip_grad_norm_(self: Any, params: Any, max_norm: Any, *, error_if_nonfinite: bool) -> Any:
        raise AssertionError("never called")

    monkeypatch.setattr(Accelerator, "clip_grad_norm_", clip_grad_norm_)
    monkeypatch.delattr(AcceleratedOptimizer, "step_was_skipped")
    with pytest.raises(AccelerateContractError) as info:
        check_accelerate()
    message = str(info.value)
    assert (
        "Accelerator.clip_grad_norm_ now takes (self, params, max_norm, error_if_nonfinite), "
        "expected (self, parameters, max_norm, norm_type)"
    ) in message
    assert "AcceleratedOptimizer.step_was_skipped is gone" in message
    assert f"tested {TESTED_ACCELERATE}" in message and "accelerate==" in message
    acc = Accelerator(cpu=True)
    with pytest.raises(AccelerateContractError):
        use_shardscale(acc)
    assert acc.scaler is None and "clip_grad_norm_" not in vars(acc)  # nothing was touched


def test_accelerate_still_builds_its_own_optimizer_and_uses_the_scaler_hook_points() -> None:
    # What the override's subclass stands on: Accelerate's step calls scaler.step and update.
    source = inspect.getsource(AcceleratedOptimizer.step)
    assert "self.scaler.step(self.optimizer" in source and "self.scaler.update()" in source
    # and FSDP2's load_state re-creates the scale through torch's private initialiser:
    scaler = ShardedGradScaler("cpu")
    scaler.load_state_dict({"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                            "growth_interval": 5, "_growth_tracker": 3})  # fmt: skip
    scaler._lazy_init_scale_growth_tracker(scaler._device)
    assert scaler.get_scale() == 8.0 and scaler.state_dict()["_growth_tracker"] == 3


# -- bad input --------------------------------------------------------------------------------


def test_bad_calls_name_the_problem_and_change_nothing() -> None:
    with pytest.raises(TypeError, match=r"takes an accelerate\.Accelerator, got str"):
        use_shardscale("accelerator")  # type: ignore[arg-type]
    acc = _accelerator()
    with pytest.raises(
        TypeError, match=r"takes a shardscale\.core\.ShardedGradScaler, got GradScaler"
    ):
        use_shardscale(acc, scaler=torch.amp.GradScaler("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="either a scaler or scaler options"):
        use_shardscale(acc, scaler=ShardedGradScaler("cpu"), init_scale=2.0)
    assert acc.scaler is None and not is_using_shardscale(acc)
    model = torch.nn.Linear(2, 2)
    acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"must run before accelerator.prepare\(\.\.\.\)"):
        use_shardscale(acc)
    assert acc.scaler is None


def test_second_call_returns_the_same_scaler() -> None:
    acc = _accelerator()
    scaler = use_shardscale(acc)
    assert use_shardscale(acc) is scaler is acc.scaler
    with pytest.raises(RuntimeError, match="already applied"):
        use_shardscale(acc, init_scale=4.0)


def test_second_call_with_the_same_options_returns_the_same_scaler() -> None:
    # The docs promise it; it used to raise whenever options were passed again.
    acc = _accelerator()
    scaler = use_shardscale(acc, init_scale=2.0**12, growth_interval=7)
    assert use_shardscale(acc, init_scale=2.0**12, growth_interval=7) is scaler
    assert use_shardscale(acc, growth_interval=7, init_scale=4096) is scaler  # 4096 == 2.0**12
    assert use_shardscale(acc) is scaler
    assert use_shardscale(acc, scaler=scaler) is scaler
    assert scaler.get_scale() == 2.0**12
    # Other options would be silently ignored: refused, naming what differs, nothing changed.
    with pytest.raises(RuntimeError) as info:
        use_shardscale(acc, init_scale=2.0**10, growth_interval=7)
    message = str(info.value)
    assert "already applied here with init_scale=4096.0" in message
    assert "this call asks for init_scale=1024.0" in message and "growth_interval" not in message
    with pytest.raises(RuntimeError, match="with no such options; this call asks for backoff"):
        use_shardscale(acc, init_scale=2.0**12, growth_interval=7, backoff_factor=0.25)
    with pytest.raises(RuntimeError, match="passes another scaler"):
        use_shardscale(acc, scaler=ShardedGradScaler("cpu"))
    assert acc.scaler is scaler and scaler.get_scale() == 2.0**12


def test_second_call_after_a_given_scaler() -> None:
    acc = _accelerator()
    mine = ShardedGradScaler("cpu", init_scale=8.0)
    assert use_shardscale(acc, scaler=mine) is mine
    assert use_shardscale(acc, scaler=mine) is mine and use_shardscale(acc) is mine
    with pytest.raises(RuntimeError, match=r"with a scaler you built.*init_scale"):
        use_shardscale(acc, init_scale=8.0)


def test_grad_scaler_kwargs_handler_and_options_build_the_scaler() -> None:
    acc = _accelerator(kwargs_handlers=[GradScalerKwargs(init_scale=64.0, growth_interval=3)])
    scaler = use_shardscale(acc, backoff_factor=0.25)
    assert scaler.is_enabled() and scaler.get_scale() == 64.0
    assert scaler.get_growth_interval() == 3 and scaler.get_backoff_factor() == 0.25
    assert not use_shardscale(_fresh(mixed_precision="bf16")).is_enabled()


@pytest.mark.parametrize("precision", ["bf16", "no", "fp16"])
def test_loss_scaling_false_enables_the_guard_on_any_precision(precision: str) -> None:
    from shardscale.core import SpikeSkip

    spike = SpikeSkip()
    scaler = use_shardscale(
        _fresh(mixed_precision=precision), loss_scaling=False, spike=spike, check_loss=True
    )
    assert scaler.is_enabled() and not scaler.loss_scaling and scaler.get_scale() == 1.0
    assert scaler.spike is spike
    # enabled=False still wins when asked for.
    off = use_shardscale(_fresh(mixed_precision=precision), loss_scaling=False, enabled=False)
    assert not off.is_enabled()


def _fresh(**kw: Any) -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return _accelerator(**kw)


# -- a real loop in one process ---------------------------------------------------------------


def _loop(acc: Accelerator, *, fused: bool, overflow_at: int, steps: int, clip: float) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=fused)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    g = torch.Generator().manual_seed(3)
    rows = []
    for step in range(steps):
        loss = (model(torch.randn(4, 6, generator=g)) - 1).pow(2).mean()
        acc.backward(loss * math.inf if step == overflow_at else loss)
        norm = acc.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        rows.append((acc.optimizer_step_was_skipped, float(norm)))
    return model, opt, sched, rows


def test_fused_adamw_overflow_is_reported_and_the_scheduler_holds(tmp_path: Path) -> None:
    acc = _accelerator()
    scaler = use_shardscale(acc, init_scale=512.0)
    _model, opt, sched, rows = _loop(acc, fused=True, overflow_at=1, steps=4, clip=0.1)
    assert isinstance(opt, ShardscaleAcceleratedOptimizer)
    assert [skipped for skipped, _ in rows] == [False, True, False, False]
    assert not math.isfinite(rows[1][1]) and all(math.isfinite(n) for _, n in rows[2:])
    assert sched.scheduler.last_epoch == 3 and scaler.get_scale() == 256.0
    # The scale tensor is there to read without a sync; get_scale() agrees.
    assert scaler.scale_tensor is not None and float(scaler.scale_tensor) == 256.0
    acc.save_state(str(tmp_path))
    assert torch.load(tmp_path / "scaler.pt", weights_only=True)["scale"] == 256.0
    acc2 = _fresh()
    scaler2 = use_shardscale(acc2, init_scale=2.0**16)
    _, _, sched2, _ = _loop(acc2, fused=True, overflow_at=-1, steps=0, clip=0.1)
    acc2.load_state(str(tmp_path))
    assert scaler2.get_scale() == 256.0 and sched2.scheduler.last_epoch == 3


# Each reason injected at a known step (the test's own decision): an inf loss under fp16
# (OVERFLOW), a loss times 1e4 (SPIKE: the norm, checked here with torch's, far above the
# threshold), a nan constant added to the loss (LOSS: finite gradients), a nan loss times the
# gradients without loss scaling (NONFINITE).
_REASONS = {
    "fp16": {1: "OVERFLOW", 3: "LOSS"},
    "bf16": {1: "SPIKE", 3: "LOSS", 4: "NONFINITE"},
}
_SPIKE_ABS = 1e3


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_every_skip_reason_holds_the_prepared_scheduler_without_a_host_read(
    precision: str,
) -> None:
    from shardscale.core import SkipReason, SpikeSkip

    inject = _REASONS[precision]
    acc = _accelerator(mixed_precision=precision)
    options: dict[str, Any] = {"check_loss": True}
    if precision == "fp16":
        options["init_scale"] = 512.0
    else:
        options.update(loss_scaling=False, spike=SpikeSkip(max_norm_abs=_SPIKE_ABS, z=None))
    scaler = use_shardscale(acc, **options)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    raw = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(raw, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, raw, sched)
    assert isinstance(sched, ShardscaleAcceleratedScheduler)
    lrs: list[float] = []  # the lr each optimizer step used (fused: every step runs it)
    raw.register_step_pre_hook(lambda o, *_: lrs.append(float(o.param_groups[0]["lr"])))
    g = torch.Generator().manual_seed(3)
    steps, reasons, reads, norms = 6, [], [], []
    for step in range(steps):
        loss = (model(torch.randn(4, 6, generator=g)).float() - 1).pow(2).mean()
        what = inject.get(step)
        if what == "OVERFLOW":
            loss = loss * math.inf
        elif what == "NONFINITE":
            loss = loss * math.nan
        elif what == "SPIKE":
            loss = loss * 1e4
        elif what == "LOSS":
            loss = loss + torch.tensor(math.nan)  # a constant: no gradient of its own
        acc.backward(loss)
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        acc.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        with HostReadRecorder() as asked:
            sched.step()
        reads.append(asked.seen)
        opt.zero_grad()
        reasons.append(SkipReason(int(scaler.last_skip_reason)))  # the test's host read
    if precision == "bf16":  # the spike is one by torch's norm, the clean steps are not
        assert norms[1] > _SPIKE_ABS > max(n for i, n in enumerate(norms) if i not in inject)
    assert reasons == [
        SkipReason[inject[i]] if i in inject else SkipReason.NONE for i in range(steps)
    ]
    assert reads == [[]] * steps  # Accelerate's own scheduler reads each flag with bool()
    # torch's StepLR advanced once per step taken before each optimizer step.
    ref_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
    ref = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    expected = []
    for step in range(steps):
        expected.append(ref.get_last_lr()[0])
        if step not in inject:
            ref_opt.step()
            ref.step()
    assert lrs == expected  # the same host float arithmetic in torch: equal exactly
    assert sched.get_last_lr() == ref.get_last_lr()
    assert sched.scheduler.last_epoch == steps - len(inject)


def test_a_one_cycle_schedule_stops_at_its_end_as_accelerates_own_does() -> None:
    # OneCycleLR raises when stepped past total_steps; Accelerate's scheduler stops there, and
    # so must the deferred advance. Both runs must end in the same state.
    def run(use: bool) -> tuple[int, list[float]]:
        acc = _fresh(mixed_precision="no")
        if use:
            use_shardscale(acc, loss_scaling=False)
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        raw = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.OneCycleLR(raw, max_lr=0.1, total_steps=3)
        model, opt, sched = acc.prepare(model, raw, sched)
        for _ in range(5):
            acc.backward(model(torch.ones(2, 3)).sum())
            opt.step()
            sched.step()
            opt.zero_grad()
        return sched.scheduler.last_epoch, sched.get_last_lr()

    theirs = run(False)
    assert theirs[0] == 3  # Accelerate's own: total_steps steps, then no more
    assert run(True) == theirs


def test_bf16_clip_is_torchs_clip_with_the_scaler_off() -> None:
    # No loss scaling, only the clipping: the same numbers as torch's clip_grad_norm_.
    acc = _accelerator(mixed_precision="no")
    assert not use_shardscale(acc).is_enabled()
    _model, _, _, rows = _loop(acc, fused=False, overflow_at=-1, steps=1, clip=0.05)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    g = torch.Generator().manual_seed(3)
    (ref(torch.randn(4, 6, generator=g)) - 1).pow(2).mean().backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    assert rows[0][1] == float(expected)  # same reduction over the same float32 values


# -- the registry -----------------------------------------------------------------------------


def test_listed_by_the_registry_without_importing_accelerate() -> None:
    code = (
        "import json, sys\n"
        "from shardscale.core import get_registry\n"
        "info = [p for p in get_registry().plugins() if p.name == 'accelerate']\n"
        "print(json.dumps({'info': [[i.distribution, list(i.hooks)] for i in info],"
        " 'imported': 'accelerate' in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"info": [["shardscale-accelerate", []]], "imported": False}


def test_clip_of_a_parameter_subset_is_the_subsets_global_norm() -> None:
    # Not one optimizer's parameters: unscale them all, then clip exactly the subset.
    acc = _accelerator()
    scaler = use_shardscale(acc, init_scale=128.0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(model(torch.randn(4, 3)).square().mean())
    subset = list(model[1].parameters())
    scaled = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    norm = acc.clip_grad_norm_(subset, 1e-3)
    unscaled = [g / 128.0 for g in scaled]
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in unscaled[2:]]))
    assert float(norm) == pytest.approx(float(expected), rel=1e-6)  # float32 norms of 15 values
    # The other layer is unscaled and not clipped; the subset is clipped to max_norm.
    for p, g in zip(model[0].parameters(), unscaled[:2], strict=True):
        assert torch.equal(p.grad, g)  # type: ignore[arg-type]
    assert float(torch.nn.utils.get_total_norm([p.grad for p in subset])) == pytest.approx(  # type: ignore[misc]
        1e-3, rel=1e-5
    )
    opt.step()
    assert not acc.optimizer_step_was_skipped and scaler.get_scale() == 128.0


def test_fused_backward_clip_and_step_read_nothing_on_the_host() -> None:
    acc = _accelerator()
    use_shardscale(acc)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model, opt = acc.prepare(model, opt)
    reads = []
    for step in range(3):
        mode = HostReadRecorder()
        with mode:
            acc.backward(model(torch.randn(2, 4)).square().mean())
            acc.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        reads.append(mode.seen)
        if step == 2:
            with HostReadRecorder() as asked:
                assert not acc.optimizer_step_was_skipped
            assert len(asked.seen) == 1  # the skip flag, read only when asked
    assert reads[1:] == [[], []]  # the first step checks the backend chain once


def test_gradient_accumulation_skips_the_step_an_overflowing_micro_batch_feeds() -> None:
    acc = _accelerator(gradient_accumulation_steps=2)
    scaler = use_shardscale(acc, init_scale=64.0)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model, opt = acc.prepare(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    flags = []
    for micro in range(4):
        with acc.accumulate(model):
            loss = model(torch.randn(2, 3)).square().mean()
            acc.backward(loss * math.inf if micro == 0 else loss)  # poisons optimizer step 0
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            if acc.sync_gradients:
                flags.append(acc.optimizer_step_was_skipped)
                if micro == 1:  # the skipped step left the weights alone
                    assert all(
                        torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)
                    )
    assert flags == [True, False] and scaler.get_scale() == 32.0
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def _branches() -> tuple[torch.nn.Linear, torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1), torch.nn.Linear(3, 1), torch.randn(4, 3)


def test_two_optimizers_each_skip_on_their_own_overflow_with_one_backoff() -> None:
    # Two branches, each with its own optimizer and scheduler; only the first branch overflows.
    # torch's rule: an optimizer steps unless its own gradients overflowed, one update per
    # iteration. The schedulers are stepped between the optimizers' steps, before that update.
    acc = _accelerator()
    scaler = use_shardscale(acc, init_scale=64.0)
    a, b, x = _branches()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=1, gamma=0.5)
    opt_a, opt_b, sched_a, sched_b = acc.prepare(opt_a, opt_b, sched_a, sched_b)
    before_a = a.weight.detach().clone()
    acc.backward(a(x).sum() * math.inf + b(x).sum())
    opt_a.step()
    sched_a.step()
    opt_b.step()
    sched_b.step()
    assert opt_a.step_was_skipped and not opt_b.step_was_skipped
    assert acc.optimizer_step_was_skipped  # any of them
    assert sched_a.scheduler.last_epoch == 0 and sched_b.scheduler.last_epoch == 1
    # torch's recipe on the same branches: step each, ONE update.
    ref_a, ref_b, _ = _branches()
    ref_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref_a, ref_b)]
    ref = torch.amp.GradScaler("cpu", init_scale=64.0)
    ref.scale(ref_a(x).sum() * math.inf + ref_b(x).sum()).backward()
    for opt in ref_opts:
        ref.step(opt)
    ref.update()
    assert torch.equal(a.weight, before_a) and torch.equal(a.weight, ref_a.weight)
    # b's gradients unscaled by the scale they were scaled with (64), not the backed-off 32.
    assert torch.equal(b.weight, ref_b.weight) and torch.equal(b.bias, ref_b.bias)
    assert scaler.get_scale() == ref.get_scale() == 32.0  # one backoff, not one per optimizer


def test_unscale_then_clip_unscales_once() -> None:
    # accelerator.unscale_gradients() (to inspect the gradients) before clip_grad_norm_: the clip
    # must not unscale again, nor refuse.
    acc = _accelerator()
    use_shardscale(acc, init_scale=128.0)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(model(torch.randn(4, 3)).square().mean())
    acc.unscale_gradients()
    unscaled = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    norm = acc.clip_grad_norm_(model.parameters(), math.inf)  # measure only
    expected = torch.nn.utils.get_total_norm(unscaled)
    assert float(norm) == pytest.approx(float(expected), rel=1e-6)  # float32 norms of 8 values
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), unscaled, strict=True))  # type: ignore[arg-type]
    opt.step()
    assert not acc.optimizer_step_was_skipped


@pytest.mark.parametrize("subset", [False, True], ids=["all-params", "subset"])
@pytest.mark.parametrize("kernels", ["recording", None])
def test_both_clip_paths_use_the_scalers_kernels(subset: bool, kernels: str | None) -> None:
    # The recording kernels run only when the scaler names them; "norms" is a clip's norm read
    # (the scaler's own unscale records "unscale"). A clip that dropped the scaler's kernels
    # would read the norm with the built-in ones.
    recorder = RecordingKernels()
    registry = Registry()
    registry.register(recorder, name="recording-kernels")
    acc = _accelerator()
    use_shardscale(acc, scaler=ShardedGradScaler("cpu", kernels=kernels, registry=registry))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(model(torch.randn(4, 4, generator=torch.Generator().manual_seed(1))).sum())
    # One optimizer's parameters: the clip fused with the unscale; a subset: unscale_gradients,
    # then the scaler's clip.
    norm = acc.clip_grad_norm_(model[-1].parameters() if subset else model.parameters(), 0.01)
    opt.step()
    assert torch.isfinite(norm)
    if kernels is None:
        assert recorder.calls == []  # never chosen by itself
    else:
        assert recorder.calls.count("norms") == 1 and recorder.calls.count("mul") == 1


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_device_schedule_and_ema_hold_on_a_spike_skip_in_bf16() -> None:
    """The skip-aware pieces of core through the one option: LR and EMA advance on taken steps.

    The reference is torch's own: ``LinearLR`` stepped and ``AveragedModel.update_parameters``
    called only on the steps this test decides were taken (a loss blown up by 1e4 at SPIKE
    gives a norm above the threshold, measured here with torch in float64).
    """
    import copy

    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from shardscale.core import SpikeSkip
    from shardscale.schedules import DeviceLRSchedule, LinearSchedule, update_averaged_model

    steps, spike_at, threshold = 6, 2, 100.0
    acc = _accelerator(mixed_precision="bf16")
    scaler = use_shardscale(
        acc, loss_scaling=False, spike=SpikeSkip(max_norm_abs=threshold, z=None)
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ref_ema = copy.deepcopy(ema)
    raw = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)  # reads a tensor lr
    sched = DeviceLRSchedule(
        raw, LinearSchedule(start_factor=1.0, end_factor=0.1, steps=4), scaler=scaler
    )
    ref_sched = torch.optim.lr_scheduler.LinearLR(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),
        start_factor=1.0, end_factor=0.1, total_iters=4,
    )  # fmt: skip
    model, opt = acc.prepare(model, raw)
    taken = []
    for step in range(steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        loss = model(x).float().square().mean() * (1e4 if step == spike_at else 1.0)
        acc.backward(loss)
        norm = float(torch.nn.utils.get_total_norm([p.grad.double() for p in model.parameters()]))
        taken.append(norm <= threshold)
        opt.step()
        sched.step()
        update_averaged_model(ema, model, scaler=scaler)
        opt.zero_grad()
        if taken[-1]:
            ref_sched.step()
            ref_ema.update_parameters(model)
        # The learning rate the next step uses: torch's stepped on the taken steps only.
        assert float(raw.param_groups[0]["lr"]) == pytest.approx(ref_sched.get_last_lr()[0])
    assert taken == [i != spike_at for i in range(steps)]
    assert acc.optimizer_step_was_skipped is False and int(scaler.last_skip_reason) == 0
    for a, b in zip(ema.state_dict().values(), ref_ema.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # update_averaged_model is bit-exact to update_parameters
