"""The W&B observer in W&B's offline mode, read back from the run's own transaction log
(see ``integration_tests/wandb_log.py``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from shardscale import telemetry
from shardscale.core import SkipReason
from shardscale.telemetry import TelemetryConfigError, WandbObserver

pytest.importorskip("wandb", reason="the wandb extra is not installed")

from wandb_log import history


def test_offline_run_holds_one_history_row_per_step(
    loop: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    poison = frozenset({1})
    observer = WandbObserver("shardscale-test")
    with telemetry.enable(observer, flush_every=3):
        truth = loop.train(5, poison=poison, init_scale=2048.0, growth_interval=2)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = [r for r in history(run_dir) if "shardscale/step" in r]
    assert [r["shardscale/step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["shardscale/scale"] for r in rows] == truth.scales
    assert [r["shardscale/skipped"] for r in rows] == [int(s) for s in truth.skipped]
    assert [r["shardscale/overflow_ranks"] for r in rows] == [int(s) for s in truth.skipped]
    overflow = int(SkipReason.OVERFLOW)  # fp16 scaling: a poisoned gradient is an overflow
    assert [r["shardscale/skip_reason"] for r in rows] == [overflow * s for s in truth.skipped]
    by_hand = loop.expected_scales(5, poison, init=2048.0, interval=2)
    assert [r["shardscale/growth_tracker"] for r in rows] == [t for _, t in by_hand]
    for r, norm in zip(rows, truth.norms, strict=True):
        if math.isfinite(norm):
            assert r["shardscale/grad_norm"] == norm  # float32 norm, exact in JSON
    assert observer.run is None  # finished: the observer started it


def test_bad_project() -> None:
    with pytest.raises(TelemetryConfigError, match="project must be a non-empty string"):
        WandbObserver("  ")
