"""The demo's files: strict JSON with non-finite numbers, a re-used folder, per-rank status."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from shardscale.cli._options import prepare_out
from shardscale.cli._rankstatus import (
    RankStatus,
    RankStatusWriter,
    describe_every_rank,
    describe_ranks,
    read_rank_status,
)
from shardscale.cli._report import render_report, scale_changes, write_json


def _strict_load(text: str) -> object:
    def refuse(name: str) -> object:
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_write_json_turns_non_finite_numbers_into_null(tmp_path: Path) -> None:
    doc = {"loss": math.nan, "norms": [1.5, math.inf, -math.inf], "nested": {"x": (math.nan,)}}
    path = write_json(tmp_path / "m.json", doc)
    assert _strict_load(path.read_text()) == {
        "loss": None,
        "norms": [1.5, None, None],
        "nested": {"x": [None]},
    }
    assert not list(tmp_path.glob("*.tmp"))


def _doc(losses: list[float | None], scales: list[float], final_scale: float) -> dict[str, object]:
    history = [
        {"step": i + 1, "loss": loss, "scale": s, "grad_norm": None if loss is None else 0.5,
         "skipped": loss is None, "skipped_total": 0, "lr": 1e-3, "elapsed_s": 0.1}
        for i, (loss, s) in enumerate(zip(losses, scales, strict=True))
    ]  # fmt: skip
    return {
        "config": {"max_norm": 1.0},
        "run": {
            "parameters": 1000,
            "corpus": "c",
            "world_size": 2,
            "mesh_desc": "FSDP over 2",
            "device": "cpu",
            "precision": "fp16",
            "backend": "c10d",
            "tokens_per_step": 64,
        },
        "summary": {
            "first_loss": losses[0],
            "final_loss": None,
            "held_out_loss": None,
            "skipped_steps": 1,
            "final_scale": final_scale,
            "wall_s": 2.0,
            "params_sha256": "ab" * 32,
            "sample": "",
        },
        "history": history,
    }


def test_report_of_a_diverged_run_says_nan_instead_of_failing(tmp_path: Path) -> None:
    # A run whose loss went nan: metrics.json holds nulls, and the report still renders.
    path = write_json(tmp_path / "metrics.json", _doc([4.0, 3.0, math.nan], [8.0, 8.0, 8.0], 4.0))
    text = io.StringIO()
    render_report(json.loads(path.read_text()), tmp_path, stream=text, plot=False)
    out = text.getvalue()
    assert "held-out loss" in out and "nan" in out
    assert "-> 4 (1 backoffs, 0 growths)" in out


def test_scale_changes_counts_backoffs_and_growths() -> None:
    assert scale_changes([8.0, 4.0, 4.0, 8.0, 16.0, 2.0]) == (2, 2)
    assert scale_changes([]) == (0, 0) and scale_changes([1.0]) == (0, 0)


def test_prepare_out_clears_only_the_files_a_run_writes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    stale = ["metrics.json", "training.png", "result-rank0.json", "result-rank3.json",
             "metrics.json.tmp", "logs/rank0.log", "logs/rank5.log", "logs/rank1.progress"]  # fmt: skip
    keep = ["notes.txt", "logs/mine.txt", "result-summary.csv"]
    for name in stale + keep:
        (out / name).write_text("old")
    prepare_out(out, logs=True)
    assert [n for n in stale if (out / n).exists()] == []
    assert all((out / n).read_text() == "old" for n in keep)
    # The training script's own clean-up (logs=False) leaves the demo's logs alone.
    (out / "logs" / "rank0.log").write_text("new")
    (out / "result-rank1.json").write_text("old")
    prepare_out(out, logs=False)
    assert (out / "logs" / "rank0.log").read_text() == "new"
    assert not (out / "result-rank1.json").exists()


def test_prepare_out_creates_the_folder(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b"
    prepare_out(out, logs=True)
    assert out.is_dir() and list(out.iterdir()) == []


def test_rank_status_round_trip_and_description(tmp_path: Path) -> None:
    assert read_rank_status(tmp_path, 2) == [None, None]
    r0 = RankStatusWriter(tmp_path, rank=0, steps=10)
    r1 = RankStatusWriter(tmp_path, rank=1, steps=10)
    r0.update("training", 3)
    statuses = read_rank_status(tmp_path, 2)
    assert statuses == [RankStatus(0, "training", 3, 10), None]
    assert describe_ranks(statuses) == "rank 0 step 3/10, rank 1 starting"
    r1.update("joining the process group")
    assert "rank 1 joining the process group" in describe_ranks(read_rank_status(tmp_path, 2))
    r1.update("training", 2)
    assert describe_ranks(read_rank_status(tmp_path, 2)) == ""  # one step apart: normal
    r0.update("training", 9)
    assert describe_ranks(read_rank_status(tmp_path, 2)) == (
        "slowest: rank 1 step 2/10 (rank 0 at 9)"
    )
    assert describe_every_rank(read_rank_status(tmp_path, 2)) == (
        "rank 0 step 9/10, rank 1 step 2/10"
    )
    (tmp_path / "rank1.progress").write_text("{half a li")  # unreadable: treated as unknown
    assert read_rank_status(tmp_path, 2)[1] is None
    RankStatusWriter(None, rank=0, steps=1).update("training", 1)  # no folder: a no-op
