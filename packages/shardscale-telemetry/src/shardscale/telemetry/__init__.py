"""shardscale.telemetry: the scaler's steps to JSONL, TensorBoard and W&B, opt-in, no per-step sync.

Nothing is written until you turn it on, in code::

    from shardscale import telemetry

    telemetry.enable(
        telemetry.JsonlObserver("runs/steps.jsonl"),
        telemetry.TensorBoardObserver("runs/tb"),
        flush_every=100,  # one host read per 100 steps
    )

or, with no code change (e.g. under ``torchrun``), with one environment variable::

    SHARDSCALE_TELEMETRY=jsonl:runs/steps.jsonl,tensorboard:runs/tb,every=100

Every ``ShardedGradScaler.update()`` in the process is then recorded as one
row (step, scale, skipped and why, grad norm, growth and hysteresis trackers,
and which ranks overflowed), on rank 0 unless ``ranks`` says otherwise.
"""

from __future__ import annotations

from shardscale.telemetry._enable import enable
from shardscale.telemetry._errors import TelemetryConfigError
from shardscale.telemetry._jsonl import JsonlObserver
from shardscale.telemetry._kinds import OBSERVER_KINDS, ObserverKind, observer_kinds
from shardscale.telemetry._observer import Observer
from shardscale.telemetry._rows import StepRow, read_rows
from shardscale.telemetry._session import (
    Telemetry,
    close_all,
    disable,
    flush,
    observers_from_spec,
    reset,
    sessions,
)
from shardscale.telemetry._spec import (
    DEFAULT_FLUSH_EVERY,
    ENV,
    SinkSpec,
    TelemetrySpec,
    parse_spec,
    spec_from_env,
)
from shardscale.telemetry._tensorboard import (
    TENSORBOARD_TAGS,
    TensorBoardObserver,
    tensorboard_unavailable_reason,
)
from shardscale.telemetry._wandb import WandbObserver, wandb_unavailable_reason

__all__ = [
    # turning it on and off
    "enable",
    "disable",
    "flush",
    "close_all",
    "reset",
    "sessions",
    "Telemetry",
    # observers
    "Observer",
    "JsonlObserver",
    "TensorBoardObserver",
    "WandbObserver",
    "TENSORBOARD_TAGS",
    "tensorboard_unavailable_reason",
    "wandb_unavailable_reason",
    # rows
    "StepRow",
    "read_rows",
    # the environment variable
    "ENV",
    "DEFAULT_FLUSH_EVERY",
    "OBSERVER_KINDS",
    "ObserverKind",
    "observer_kinds",
    "parse_spec",
    "spec_from_env",
    "observers_from_spec",
    "SinkSpec",
    "TelemetrySpec",
    "TelemetryConfigError",
]
