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

from shardscale.core import ShardedGradScaler
from shardscale.core.testing import HostReadRecorder
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
        held.step()
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
