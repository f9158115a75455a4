"""use_shardscale(trainer) in one process: the contract, bad input, a real Trainer run.

The 2-rank DDP runs with injected overflow, against the Trainer without
shardscale, are in integration_tests/test_transformers.py.
"""

from __future__ import annotations

import importlib.metadata as md
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from accelerate.state import AcceleratorState, GradientState
from packaging.requirements import Requirement
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from shardscale.accelerate import ShardscaleAcceleratedOptimizer
from shardscale.core import ShardedGradScaler
from shardscale.transformers import (
    TESTED_TRANSFORMERS,
    ShardscaleCallback,
    TransformersContractError,
    check_transformers,
    is_using_shardscale,
    transformers_contract_problems,
    use_shardscale,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB, SEQ = 32, 8
INF_STEP = 2  # 0-based optimizer step whose loss is inf


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    # Accelerate keeps process-wide singletons: every test starts and ends without them.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _InfAtStep(Trainer):
    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return loss * math.inf if self.state.global_step == INF_STEP else loss


def _trainer(tmp_path: Path, cls: type[Trainer] = Trainer, **kw: Any) -> Trainer:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
    )  # fmt: skip
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, fp16=True, max_steps=5,
        per_device_train_batch_size=2, learning_rate=1e-2, lr_scheduler_type="linear",
        logging_steps=1, report_to="none", disable_tqdm=True, save_strategy="no", **kw,
    )  # fmt: skip
    return cls(model=LlamaForCausalLM(config), args=args, train_dataset=_Tokens(16))


# -- the contract with transformers -----------------------------------------------------------


def test_installed_transformers_is_the_tested_one_and_in_range() -> None:
    reqs = [Requirement(r) for r in md.requires("shardscale-transformers") or []]
    (spec,) = [r.specifier for r in reqs if r.name == "transformers"]
    assert transformers.__version__ in spec
    assert TESTED_TRANSFORMERS in spec


def test_the_installed_transformers_meets_the_contract(tmp_path: Path) -> None:
    assert transformers_contract_problems(_trainer(tmp_path)) == []


def test_a_changed_signature_fails_before_anything_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def _clip_grad_norm(self: Any, max_norm: float) -> Any:
        raise AssertionError("never called")

    trainer = _trainer(tmp_path)
    monkeypatch.setattr(Trainer, "_clip_grad_norm", _clip_grad_norm)
    with pytest.raises(TransformersContractError) as info:
        use_shardscale(trainer)
    message = str(info.value)
    assert "Trainer._clip_grad_norm now takes (self, max_norm), expected (self, model)" in message
    assert f"tested {TESTED_TRANSFORMERS}" in message
    # Nothing was touched.
    assert trainer.accelerator.scaler is None
    assert "_clip_grad_norm" not in trainer.__dict__
    assert not any(isinstance(cb, ShardscaleCallback) for cb in trainer.callback_handler.callbacks)
    monkeypatch.undo()
    check_transformers(trainer)


# -- bad input ----------------------------------------------------------------------------------


def test_rejects_what_is_not_a_trainer() -> None:
    with pytest.raises(
        TypeError, match=r"takes a transformers.Trainer, got Linear .*shardscale.accelerate"
    ):
        use_shardscale(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


def test_scaler_and_options_together_fail_before_anything_changes(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    with pytest.raises(ValueError, match="either a scaler or scaler options"):
        use_shardscale(trainer, scaler=ShardedGradScaler("cpu"), init_scale=8.0)
    assert trainer.accelerator.scaler is None
    assert not is_using_shardscale(trainer)


def test_second_call_returns_the_same_scaler_and_adds_one_callback(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    scaler = use_shardscale(trainer, init_scale=64.0)
    assert use_shardscale(trainer) is scaler is trainer.accelerator.scaler
    assert scaler.get_scale() == 64.0 and scaler.is_enabled()  # fp16=True enables it
    kinds = [type(cb) for cb in trainer.callback_handler.callbacks]
    assert kinds.count(ShardscaleCallback) == 1 and kinds[0] is ShardscaleCallback
    with pytest.raises(RuntimeError, match="already applied"):
        use_shardscale(trainer, init_scale=2.0)


def test_second_call_with_the_same_options_returns_the_same_scaler(tmp_path: Path) -> None:
    # docs/transformers.md: "Calling it a second time returns the same scaler" -- with the same
    # options too (it used to raise), and other options are refused naming the difference.
    trainer = _trainer(tmp_path)
    scaler = use_shardscale(trainer, init_scale=2.0**12)
    assert use_shardscale(trainer, init_scale=2.0**12) is scaler is trainer.accelerator.scaler
    kinds = [type(cb) for cb in trainer.callback_handler.callbacks]
    assert kinds.count(ShardscaleCallback) == 1
    with pytest.raises(
        RuntimeError, match=r"with init_scale=4096.0; this call asks for init_scale=2.0"
    ):
        use_shardscale(trainer, init_scale=2.0)
    assert trainer.accelerator.scaler is scaler and scaler.get_scale() == 2.0**12


def test_after_train_it_refuses(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, max_grad_norm=1.0)
    trainer.args.max_steps = 1
    trainer.train()
    with pytest.raises(RuntimeError, match=r"before trainer.train\(\)"):
        use_shardscale(trainer)


def test_the_callback_alone_refuses_a_trainer_not_on_shardscale(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    trainer.add_callback(ShardscaleCallback())
    with pytest.raises(RuntimeError, match=r"not shardscale's.*use_shardscale\(trainer\)"):
        trainer.train()


# -- a real run ---------------------------------------------------------------------------------


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_an_inf_step_is_skipped_held_and_recorded(tmp_path: Path, optim: str) -> None:
    trainer = _trainer(tmp_path, cls=_InfAtStep, max_grad_norm=1.0, optim=optim)
    use_shardscale(trainer, init_scale=256.0)
    trainer.train()
    assert isinstance(trainer.optimizer, ShardscaleAcceleratedOptimizer)
    (callback,) = [
        cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ShardscaleCallback)
    ]
    assert callback.skipped_steps == [INF_STEP + 1]
    records: Any = trainer.state.stateful_callbacks
    assert records["ShardscaleCallback"]["attributes"]["skipped_steps"] == [INF_STEP + 1]
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["skipped_steps"] for e in logs] == [0, 0, 1, 1, 1]
    # loss_scale is read after the step's update: the skipped step's own entry shows the backoff.
    assert [e["loss_scale"] for e in logs] == [256.0, 256.0, 128.0, 128.0, 128.0]
    # global_step counts the skipped step like any other (docs/transformers.md says so).
    assert [e["step"] for e in logs] == [1, 2, 3, 4, 5] and trainer.state.global_step == 5
    # The scheduler held on the skipped step: 4 of 5 linear decay steps.
    assert trainer.lr_scheduler.last_epoch == 4
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(1e-2 * (1 - 4 / 5))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_disabled_scaler_logs_scale_one_and_no_skips(tmp_path: Path, precision: str) -> None:
    # Without fp16 the scaler is disabled; the page says what the logs then carry.
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
    )  # fmt: skip
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, bf16=precision == "bf16", max_steps=2,
        per_device_train_batch_size=2, logging_steps=1, report_to="none", disable_tqdm=True,
        save_strategy="no",
    )  # fmt: skip
    trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=_Tokens(8))
    scaler = use_shardscale(trainer)
    assert not scaler.is_enabled()
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [(e["loss_scale"], e["skipped_steps"]) for e in logs] == [(1.0, 0), (1.0, 0)]


# -- listed and checked by the shardscale command ----------------------------------------------


def test_plugins_lists_it_and_doctor_checks_its_transformers() -> None:
    pytest.importorskip("shardscale.cli")  # the command is another distribution
    from shardscale.cli._doctor import _integration_checks
    from shardscale.core import get_registry

    names = {(p.name, p.distribution) for p in get_registry().plugins()}
    assert ("transformers", "shardscale-transformers") in names
    (finding,) = [f for f in _integration_checks() if f.check == "shardscale-transformers"]
    assert finding.status == "ok", finding
    assert f"with transformers {transformers.__version__}" in finding.detail
