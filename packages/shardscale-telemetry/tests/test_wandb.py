"""The W&B observer in W&B's offline mode, read back from the run's own transaction log.

An offline run keeps every record it would upload in ``run-<id>.wandb``: a
7-byte header (``:W&B``, a magic number, a version) followed by LevelDB-log
framed records, each a ``wandb.proto.wandb_internal_pb2.Record``. The history
rows are read from there, with W&B's own protobuf classes.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest

from shardscale import telemetry
from shardscale.telemetry import TelemetryConfigError, WandbObserver

pytest.importorskip("wandb", reason="the wandb extra is not installed")

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    out, pos, partial = [], _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        body = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0 and length == 0:
            continue
        if kind == _FULL:
            out.append(body)
        elif kind == _FIRST:
            partial = body
        elif kind == _MIDDLE:
            partial += body
        elif kind == _LAST:
            out.append(partial + body)
    return out


def _history(run_dir: Path) -> list[dict[str, Any]]:
    from wandb.proto import wandb_internal_pb2 as pb

    (log,) = run_dir.glob("run-*.wandb")
    rows = []
    for raw in _records(log):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    "/".join(item.nested_key) or item.key: json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


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
    rows = [r for r in _history(run_dir) if "shardscale/step" in r]
    assert [r["shardscale/step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["shardscale/scale"] for r in rows] == truth.scales
    assert [r["shardscale/skipped"] for r in rows] == [int(s) for s in truth.skipped]
    assert [r["shardscale/overflow_ranks"] for r in rows] == [int(s) for s in truth.skipped]
    by_hand = loop.expected_scales(5, poison, init=2048.0, interval=2)
    assert [r["shardscale/growth_tracker"] for r in rows] == [t for _, t in by_hand]
    for r, norm in zip(rows, truth.norms, strict=True):
        if math.isfinite(norm):
            assert r["shardscale/grad_norm"] == norm  # float32 norm, exact in JSON
    assert observer.run is None  # finished: the observer started it


def test_bad_project() -> None:
    with pytest.raises(TelemetryConfigError, match="project must be a non-empty string"):
        WandbObserver("  ")
