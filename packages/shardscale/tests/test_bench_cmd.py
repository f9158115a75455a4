"""``shardscale bench``: runs shardscale-clip's benchmark, prints the table, writes JSON and a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardscale.cli._ui import have_matplotlib

TINY = ["--world-size", "2", "--width", "32", "--hidden", "64", "--blocks", "1", "--batch", "2",
        "--steps", "2", "--warmup", "1", "--meshes", "1d", "--optimizers", "sgd", "--device", "cpu"]  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_bench_writes_table_json_and_chart(run_cli, tmp_path: Path) -> None:
    proc = run_cli(["bench", *TINY, "--out", str(tmp_path)], timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["config"]["world_size"] == 2
    (row,) = result["rows"]
    assert (row["mesh"], row["optimizer"]) == ("1d", "sgd")
    assert {"torch", "ours"} <= set(row["recipes"])
    assert row["recipes"]["torch"]["post_ratio"] == pytest.approx(1.0)
    # Our recipe issues one collective per step (the design's promise; torch issues more).
    assert row["recipes"]["ours"]["collectives"] == 1
    assert row["recipes"]["torch"]["collectives"] > row["recipes"]["ours"]["collectives"]
    for word in ("torch", "ours", "post ms", str(tmp_path / "bench.json")):
        assert word in proc.stdout
    if have_matplotlib():
        assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert str(tmp_path / "bench.png") in proc.stdout
    else:  # installed without the ui extra: the table and JSON, and a hint instead of the chart
        assert "pip install 'shardscale[ui]'" in proc.stdout


def test_bench_bad_mesh_is_refused(run_cli, tmp_path: Path) -> None:
    proc = run_cli(["bench", "--meshes", "3d", "--out", str(tmp_path)], timeout=60)
    assert proc.returncode == 2 and "3d" in proc.stderr
