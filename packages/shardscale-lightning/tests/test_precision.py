"""ShardscalePrecision in one process: Lightning's contract, bad input, a real Trainer, no host sync.

The 2-rank DDP and ModelParallel (FSDP2) runs with injected overflow are in
integration_tests/test_lightning.py.
"""

from __future__ import annotations

import importlib.metadata as md
import inspect
import json
import math
import subprocess
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision, Precision
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from packaging.requirements import Requirement

from shardscale.core import Registry, ShardedGradScaler
from shardscale.core.testing import HostReadRecorder, RecordingKernels
from shardscale.lightning import ShardscalePrecision, hold_on_skipped_steps, is_held

# -- what the plugin relies on in Lightning ---------------------------------------------------


def test_lightning_version_is_in_the_declared_range() -> None:
    reqs = [Requirement(r) for r in md.requires("shardscale-lightning") or []]
    (spec,) = [r.specifier for r in reqs if r.name == "lightning"]
    assert md.version("lightning") in spec


def test_sets_every_attribute_lightnings_fsdp_plugin_sets() -> None:
    # __init__ does FSDPPrecision's work itself (to avoid building torch's scaler): when
    # Lightning adds an attribute there, this fails instead of an AttributeError mid-training.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's FSDP scaler warns without CUDA
        theirs = FSDPPrecision("16-mixed")
    ours = ShardscalePrecision("16-mixed", device="cpu")
    assert set(vars(theirs)) <= set(vars(ours))
    assert isinstance(ours.scaler, ShardedGradScaler)
    assert ours.mixed_precision_config.param_dtype == torch.float16  # inherited, for FSDP1


def test_hooks_it_overrides_or_calls_keep_their_signatures() -> None:
    def names(fn: Any) -> list[str]:
        return list(inspect.signature(fn).parameters)

    assert names(Precision._after_closure) == ["self", "model", "optimizer"]
    assert names(Precision.connect) == ["self", "model", "optimizers", "lr_schedulers"]
    assert names(FSDPPrecision.optimizer_step)[:4] == ["self", "optimizer", "model", "closure"]
    assert names(Precision.clip_gradients) == [
        "self", "optimizer", "clip_val", "gradient_clip_algorithm"
    ]  # fmt: skip
    assert names(pl.LightningModule.log)[:3] == ["self", "name", "value"]


def test_fsdp_and_model_parallel_strategies_accept_it() -> None:
    plugin = ShardscalePrecision("16-mixed", device="cpu")
    assert FSDPStrategy(precision_plugin=plugin).precision_plugin is plugin
    strategy = ModelParallelStrategy()
    strategy.precision_plugin = plugin  # what the Trainer's connector does with plugins=[...]
    assert strategy.precision_plugin is plugin


# -- bad input --------------------------------------------------------------------------------


def test_bad_arguments_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"'64-true'\) is not supported; use one of"):
        ShardscalePrecision("64-true")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"takes a shardscale\.core\.ShardedGradScaler, got GradScaler"
    ):
        ShardscalePrecision("16-mixed", scaler=torch.amp.GradScaler("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"does not scale the loss.*\['init_scale'\]"):
        ShardscalePrecision("bf16-mixed", init_scale=8.0)
    with pytest.raises(ValueError, match="either a scaler or scaler options"):
        ShardscalePrecision("16-mixed", scaler=ShardedGradScaler("cpu"), init_scale=8.0)
    with pytest.raises(ValueError, match="init_scale"):
        ShardscalePrecision("16-mixed", device="cpu", init_scale=-1.0)  # the scaler's own check


def test_loss_scaling_false_is_the_one_option_of_the_guard_without_scaling() -> None:
    from shardscale.core import SpikeSkip

    # A precision that does not scale takes scaler options only with loss_scaling=False ...
    with pytest.raises(ValueError, match=r"\[.spike.\]\) need loss_scaling=False"):
        ShardscalePrecision("bf16-mixed", spike=SpikeSkip())
    with pytest.raises(ValueError, match="need loss_scaling=False"):
        ShardscalePrecision("32-true", loss_scaling=True)
    with pytest.raises(ValueError, match="must be built with loss_scaling=False"):
        ShardscalePrecision("bf16-true", scaler=ShardedGradScaler("cpu"))
    # ... which builds the guard: scale 1, the policies set, as the scaler was asked.
    spike = SpikeSkip(z=4.0)
    for precision in ("bf16-mixed", "32-true", "16-true", "bf16-true"):
        plugin = ShardscalePrecision(
            precision, device="cpu", loss_scaling=False, spike=spike, max_consecutive_skips=3
        )  # type: ignore[arg-type]
        scaler = plugin.scaler
        assert scaler is not None and not scaler.loss_scaling and scaler.get_scale() == 1.0
        assert scaler.spike is spike and scaler.max_consecutive_skips == 3
    ready = ShardedGradScaler("cpu", loss_scaling=False)
    assert ShardscalePrecision("bf16-mixed", scaler=ready).scaler is ready
    # Without the option nothing changes: no scaler for a precision that does not scale.
    assert ShardscalePrecision("bf16-mixed").scaler is None
    # 16-mixed passes the policies through to its loss-scaling scaler.
    fp16 = ShardscalePrecision("16-mixed", device="cpu", spike=spike, check_loss=True).scaler
    assert fp16 is not None and fp16.loss_scaling and fp16.spike is spike


# -- the scheduler hold -----------------------------------------------------------------------


def test_held_scheduler_waits_while_the_flag_is_set_and_keeps_its_state_dict() -> None:
    def make() -> torch.optim.lr_scheduler.LambdaLR:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)

    flag = {"skipped": torch.tensor(False)}
    held, plain = make(), make()
    hold_on_skipped_steps(held, lambda opt: flag["skipped"])
    assert is_held(held) and not is_held(plain)
    assert isinstance(held, torch.optim.lr_scheduler.LambdaLR)
    for skipped in (False, True, True, False):
        flag["skipped"] = torch.tensor(skipped)
        held.optimizer.step()
        plain.optimizer.step()
        with HostReadRecorder() as reads:
            held.step()  # the flag goes to the host as a copy, never through a read op
        assert reads.seen == []
        if not skipped:
            plain.step()
    assert held.last_epoch == plain.last_epoch == 2
    assert held.get_last_lr() == plain.get_last_lr() == [0.25]
    assert held.state_dict().keys() == plain.state_dict().keys()


def test_hold_refuses_what_is_not_a_scheduler() -> None:
    with pytest.raises(TypeError, match=r"scheduler with \.optimizer and \.step\(\), got int"):
        hold_on_skipped_steps(3, lambda opt: None)


# -- a real Trainer in one process ------------------------------------------------------------


class _Watched(ShardscalePrecision):
    """Records host reads inside every optimizer step after the first (the warm-up)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__("16-mixed", device="cpu", **kw)
        self.reads: list[list[str]] = []

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        mode = HostReadRecorder()
        with mode:
            out = super().optimizer_step(optimizer, model, closure, **kwargs)
        self.reads.append(mode.seen)
        return out


class _Net(pl.LightningModule):
    def __init__(self, *, overflow_at: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.overflow_at = overflow_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = (self.lin(batch[0]) - 1.0).pow(2).mean()
        return loss * math.inf if self.global_step == self.overflow_at else loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.1, fused=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_trainer_fused_adamw_clip_skip_and_no_host_read_in_the_step() -> None:
    plugin = _Watched(init_scale=256.0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], max_steps=5, gradient_clip_val=0.1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    data = torch.utils.data.TensorDataset(
        torch.randn(20, 4, generator=torch.Generator().manual_seed(1))
    )
    trainer.fit(_Net(overflow_at=2), torch.utils.data.DataLoader(data, batch_size=4))
    # Fused AdamW: no host read in the step, logging included (Lightning's own plugin cannot even
    # clip here). The first step is a warm-up (the backend-chain check reads its result once).
    assert plugin.reads[1:] == [[]] * 4
    assert plugin.scaler is not None and plugin.scaler.get_scale() == 128.0  # one skip
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == 4  # 5 steps, 1 skipped
    metrics = trainer.callback_metrics
    assert float(metrics["shardscale/scale"]) == 128.0
    assert float(metrics["shardscale/skipped"]) == 0.0
    assert 0 < float(metrics["shardscale/grad_norm"]) < math.inf


# -- the registry -----------------------------------------------------------------------------


class _DeviceScheduled(_Net):
    """A DeviceLRSchedule from the plugin's scaler: the lr is computed on the device."""

    def __init__(self, *, overflow_at: int) -> None:
        super().__init__(overflow_at=overflow_at)
        self.lrs: list[float] = []
        self.sched_reads: list[list[str]] = []

    def configure_optimizers(self) -> Any:
        from shardscale.schedules import DeviceLRSchedule, ExponentialSchedule

        opt = torch.optim.AdamW(self.parameters(), lr=0.1, fused=True)
        scaler = self.trainer.precision_plugin.scaler
        sched = DeviceLRSchedule(opt, ExponentialSchedule(gamma=0.5), scaler=scaler)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        # Lightning calls schedulers outside torch's LRScheduler through this hook.
        with HostReadRecorder() as reads:
            scheduler.step()
        self.sched_reads.append(reads.seen)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.lrs.append(float(self.trainer.optimizers[0].param_groups[0]["lr"]))  # test's read


def test_a_device_lr_schedule_is_left_to_itself_and_holds_on_the_skipped_step() -> None:
    from shardscale.schedules import DeviceLRSchedule

    plugin = ShardscalePrecision("16-mixed", device="cpu", init_scale=256.0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], max_steps=5, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = torch.utils.data.TensorDataset(
        torch.randn(20, 4, generator=torch.Generator().manual_seed(1))
    )
    model = _DeviceScheduled(overflow_at=2)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert type(sched) is DeviceLRSchedule and not is_held(sched)  # not held a second time
    assert model.sched_reads == [[]] * 5
    # torch's ExponentialLR advanced once per step taken before each step (step 2 overflowed).
    ref_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    ref = torch.optim.lr_scheduler.ExponentialLR(ref_opt, gamma=0.5)
    expected = []
    for step in range(5):
        expected.append(ref.get_last_lr()[0])
        if step != 2:
            ref_opt.step()
            ref.step()
    # Ours: float64 on the device, stored as a float32 lr: one rounding, 2**-24 relative.
    assert model.lrs == pytest.approx(expected, rel=2**-23, abs=0.0)
    assert int(sched.taken_steps) == 4


def test_listed_by_the_registry_without_importing_lightning() -> None:
    code = (
        "import json, sys\n"
        "from shardscale.core import get_registry\n"
        "info = [p for p in get_registry().plugins() if p.name == 'lightning']\n"
        "print(json.dumps({'info': [[i.distribution, list(i.hooks)] for i in info],"
        " 'imported': 'lightning' in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"info": [["shardscale-lightning", []]], "imported": False}


def test_shardscale_plugins_and_doctor_show_the_integration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cli = pytest.importorskip("shardscale.cli._doctor", reason="the shardscale command is absent")
    from shardscale.cli._plugins_cmd import collect_plugins

    listed = [p for p in collect_plugins()["plugins"] if p["name"] == "lightning"]
    assert listed == [
        {"name": "lightning", "distribution": "shardscale-lightning", "version": "0.1.0",
         "hooks": []}
    ]  # fmt: skip
    mine = [f for f in cli.run_checks() if f.check == "shardscale-lightning"]
    assert [(f.status, f.detail) for f in mine] == [
        ("ok", f"shardscale-lightning 0.1.0 with lightning {md.version('lightning')}")
    ]
    # A lightning outside the declared range is a warning with the command that fixes it.
    real = md.version
    monkeypatch.setattr(md, "version", lambda name: "2.5.0" if name == "lightning" else real(name))
    (finding,) = [f for f in cli.run_checks() if f.check == "shardscale-lightning"]
    assert finding.status == "warn" and "lightning 2.5.0 is outside the range" in finding.detail
    assert finding.fix == "pip install 'lightning<2.7,>=2.6.6'"


class _Norms(pl.Callback):
    def __init__(self, plugin: ShardscalePrecision) -> None:
        self.plugin = plugin
        self.norms: list[float | None] = []

    def on_train_batch_end(self, *args: Any) -> None:
        norm = self.plugin.grad_norm
        self.norms.append(None if norm is None else float(norm))


def test_bf16_clips_by_the_global_norm_on_every_step() -> None:
    # No scaler: clipping is shardscale.clip.clip_grad_norm_, the same norm as torch's.
    plugin = ShardscalePrecision("bf16-mixed", device="cpu")
    norms = _Norms(plugin)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], max_steps=3, gradient_clip_val=1e-3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[norms],
    )  # fmt: skip
    data = torch.utils.data.TensorDataset(
        torch.randn(12, 4, generator=torch.Generator().manual_seed(1))
    )
    trainer.fit(_Net(overflow_at=-1), torch.utils.data.DataLoader(data, batch_size=4))
    assert plugin.scaler is None
    assert len(norms.norms) == 3
    assert all(n is not None and 1e-3 < n < math.inf for n in norms.norms), norms.norms


class _MaxGrad(pl.Callback):
    def __init__(self) -> None:
        self.max_abs: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.max_abs.append(max(float(g.abs().max()) for g in grads))


def test_value_clipping_unscales_first_even_for_a_fused_optimizer() -> None:
    # Lightning's own plugin refuses any clipping with a fused optimizer.
    plugin = ShardscalePrecision("16-mixed", device="cpu", init_scale=2.0**10)
    seen = _MaxGrad()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], max_steps=3, gradient_clip_val=1e-3,
        gradient_clip_algorithm="value", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[seen],
    )  # fmt: skip
    data = torch.utils.data.TensorDataset(
        torch.randn(12, 4, generator=torch.Generator().manual_seed(1))
    )
    trainer.fit(_Net(overflow_at=-1), torch.utils.data.DataLoader(data, batch_size=4))
    # Unscaled, then clipped element-wise: the largest gradients sit exactly at the bound (had
    # the scaled ones been clipped, the fused step would have divided them by 1024 afterwards).
    limit = float(torch.tensor(1e-3, dtype=torch.float32))  # the bound, rounded to the grads' dtype
    assert seen.max_abs == [limit] * 3
    assert plugin.scaler is not None and plugin.scaler.get_scale() == 2.0**10  # no skips


# -- manual optimization, two optimizers ------------------------------------------------------


class _TwoBranches(pl.LightningModule):
    """Manual optimization: each branch its own optimizer and scheduler; branch `a` overflows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
        self.automatic_optimization = False
        self.flags: list[tuple[bool, bool]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        opt_a, opt_b = self.optimizers()
        sched_a, sched_b = self.lr_schedulers()  # type: ignore[misc]
        loss_a = self.a(x).float().sum()
        self.manual_backward((loss_a * math.inf if batch_idx == 0 else loss_a) + self.b(x).sum())
        # Scheduler a asks between the two steps, before the iteration's update.
        opt_a.step()
        sched_a.step()
        opt_b.step()
        sched_b.step()
        plugin = self.trainer.precision_plugin
        self.flags.append(
            (bool(plugin.step_was_skipped(opt_a)), bool(plugin.step_was_skipped(opt_b)))
        )
        opt_a.zero_grad()
        opt_b.zero_grad()

    def configure_optimizers(self) -> Any:
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (self.a, self.b)]
        # gamma=1: the lr stays, so the torch loop below needs no scheduler; last_epoch counts.
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=1.0) for o in opts]
        return opts, [{"scheduler": s, "interval": "step"} for s in scheds]


def test_manual_two_optimizers_skip_on_their_own_overflow_with_one_backoff() -> None:
    plugin = ShardscalePrecision("16-mixed", device="cpu", init_scale=64.0)
    model = _TwoBranches()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], max_steps=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)
    trainer.fit(model, loader)
    assert model.flags == [(True, False), (False, False)]
    scheds = [c.scheduler for c in trainer.lr_scheduler_configs]
    assert [s.last_epoch for s in scheds] == [1, 2]  # a held on its skipped step
    # torch's recipe on the same data, in the same autocast: step each, ONE update per batch.
    torch.manual_seed(0)
    ref_a, ref_b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    ref_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref_a, ref_b)]
    ref = torch.amp.GradScaler("cpu", init_scale=64.0)
    for i, (batch,) in enumerate(loader):
        with torch.autocast("cpu", dtype=torch.float16):
            loss_a = ref_a(batch).float().sum()
            loss = (loss_a * math.inf if i == 0 else loss_a) + ref_b(batch).sum()
            ref.scale(loss).backward()
        for opt in ref_opts:
            ref.step(opt)
        ref.update()
        for opt in ref_opts:
            opt.zero_grad()
    for ours, theirs in ((model.a, ref_a), (model.b, ref_b)):
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(p, q)  # the same float32 arithmetic, step for step
    assert plugin.scaler is not None and plugin.scaler.get_scale() == ref.get_scale() == 32.0


# -- the scaler's kernels reach every clip path ----------------------------------------------


class _Clipping(pl.LightningModule):
    """``how``: the Trainer's clip (fused with the unscale), the module's own clip hook after the
    unscale (the scaler's clip), or a manual ``self.clip_gradients`` (fused)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 2)
        self.how = how
        self.automatic_optimization = how != "manual"

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        loss = self.lin(batch[0]).square().mean()
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.01, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()
        return None

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        if self.how == "hook":
            self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="norm")
        else:
            super().configure_gradient_clipping(
                optimizer, gradient_clip_val, gradient_clip_algorithm
            )

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("how", ["trainer", "hook", "manual"])
@pytest.mark.parametrize("kernels", ["recording", None])
def test_every_clip_path_uses_the_scalers_kernels(how: str, kernels: str | None) -> None:
    # The recording kernels run only when the scaler names them; "norms" is a clip's norm read
    # (the scaler's own unscale records "unscale"). A clip that dropped the scaler's kernels
    # would read the norm with the built-in ones.
    recorder = RecordingKernels()
    registry = Registry()
    registry.register(recorder, name="recording-kernels")
    scaler = ShardedGradScaler("cpu", init_scale=256.0, kernels=kernels, registry=registry)
    plugin = ShardscalePrecision("16-mixed", device="cpu", scaler=scaler)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], max_steps=2, logger=False,
        gradient_clip_val=0.01 if how == "trainer" else None,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    trainer.fit(_Clipping(how), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), 4))
    assert plugin.grad_norm is not None  # it clipped
    if kernels is None:
        assert recorder.calls == []  # never chosen by itself
    else:  # both steps: the norm and the clip's multiply in the scaler's kernels
        assert recorder.calls.count("norms") >= 2 and recorder.calls.count("mul") >= 2
