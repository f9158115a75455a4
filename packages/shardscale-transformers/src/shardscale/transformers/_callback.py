"""``ShardscaleCallback``: skipped steps and the loss scale in ``TrainerState`` and the logs.

The scheduler hold and the checkpointed scaler need no callback (they come from
the Accelerator, see [Note: the Trainer's contract]). What the Trainer has no
place for is *which* optimizer steps the scaler skipped: ``global_step`` counts
them like any other. This callback keeps that list, in the Trainer's own
state-saving mechanism (``ExportableState``): it is written into
``trainer_state.json`` with every checkpoint and read back on resume, and
``trainer.state.stateful_callbacks["ShardscaleCallback"]`` is kept current
whenever a step is skipped. Each training log entry (those with a ``loss``)
also gets ``loss_scale`` and ``skipped_steps`` (the count so far).
"""

from __future__ import annotations

from typing import Any

from accelerate.optimizer import AcceleratedOptimizer
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from shardscale.accelerate import ShardscaleAcceleratedOptimizer
from shardscale.core import ShardedGradScaler

__all__ = ["ShardscaleCallback", "LOG_KEYS"]

#: The keys added to each training log entry.
LOG_KEYS = ("loss_scale", "skipped_steps")


def _records(state: TrainerState) -> dict[str, Any]:
    """``state.stateful_callbacks``: annotated as a list, a dict once the state exists."""
    records = state.stateful_callbacks
    if not isinstance(records, dict):
        raise RuntimeError(
            f"TrainerState.stateful_callbacks is a {type(records).__name__}, not a dict: "
            "transformers changed how callback state is kept (see check_transformers())"
        )
    return records


class ShardscaleCallback(TrainerCallback, ExportableState):  # type: ignore[misc]
    """Records the optimizer steps the scaler skipped, and logs the scale and the skip count.

    ``use_shardscale(trainer)`` adds one; it is not meant to be passed to a
    Trainer on its own (it checks at ``on_train_begin`` that the Trainer's
    optimizer went through shardscale, and raises otherwise).

    Attributes:
        skipped_steps: the ``global_step`` (1-based, as ``trainer.state.global_step``
            after the step) of every skipped optimizer step in this run,
            resumed runs included.
    """

    def __init__(self) -> None:
        self.skipped_steps: list[int] = []

    def state(self) -> dict[str, Any]:
        """What ``trainer_state.json`` stores (``ExportableState``)."""
        return {"args": {}, "attributes": {"skipped_steps": list(self.skipped_steps)}}

    def _publish(self, state: TrainerState) -> None:
        _records(state)[type(self).__name__] = self.state()

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Check the optimizer went through shardscale; start or resume the record."""
        optimizer = kwargs.get("optimizer")
        if not isinstance(optimizer, ShardscaleAcceleratedOptimizer):
            got = type(optimizer).__name__
            hint = (
                "the Trainer's accelerator was replaced after use_shardscale(trainer) "
                "(hyperparameter_search does this)"
                if isinstance(optimizer, AcceleratedOptimizer)
                else "this Trainer does not prepare its optimizer with Accelerate (DeepSpeed, "
                "SageMaker MP?)"
            )
            raise RuntimeError(
                f"ShardscaleCallback: the Trainer's optimizer is a {got}, not shardscale's: {hint}. "
                "Call shardscale.transformers.use_shardscale(trainer) right before trainer.train()."
            )
        self.skipped_steps = []
        if state.global_step > 0:  # resumed: the checkpoint's record continues
            saved = _records(state).get(type(self).__name__)
            if isinstance(saved, list):
                saved = saved[0] if saved else None
            if isinstance(saved, dict):
                steps = saved.get("attributes", {}).get("skipped_steps", [])
                self.skipped_steps = [int(s) for s in steps if int(s) <= state.global_step]
        self._publish(state)

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """After each optimizer step: record it when the scaler skipped it on every rank."""
        optimizer = kwargs.get("optimizer")
        # The Trainer read the same flag to decide on lr_scheduler.step(): no new host sync.
        if isinstance(optimizer, ShardscaleAcceleratedOptimizer) and optimizer.step_was_skipped:
            self.skipped_steps.append(state.global_step)
            self._publish(state)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        """Add ``loss_scale`` and ``skipped_steps`` to training log entries (and to
        the ``log_history`` entry the Trainer just appended)."""
        optimizer = kwargs.get("optimizer")
        if logs is None or "loss" not in logs or optimizer is None:
            return
        scaler = getattr(optimizer, "scaler", None)
        if not isinstance(scaler, ShardedGradScaler):
            return
        extra = {"loss_scale": scaler.get_scale(), "skipped_steps": len(self.skipped_steps)}
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("loss") == logs["loss"]:
            state.log_history[-1].update(extra)
