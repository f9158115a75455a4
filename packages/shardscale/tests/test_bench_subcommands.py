"""``shardscale bench host`` and ``shardscale bench scale``: smoke sizes end to end, and the
scale table's lab kept out of the ``shardscale`` wheel."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from shardscale.cli._bench_cmd import find_scale_script

REPO = Path(__file__).resolve().parents[3]
LAB = ("_scale_sim", "_nccl_model", "_scale_table", "bench/scale.py")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_host_quick_runs_and_writes_host_json(run_cli, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli(["bench", "host", "--quick", "--out", str(out)], timeout=280.0)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "host.json").read_text())
    assert [p["n_params"] for p in result["points"]] == [50, 100]
    assert result["config"]["rounds"] == 6
    assert "smoke run: too few rounds for verdicts" in proc.stdout
    assert re.search(r"^\s*50\s", proc.stdout, re.M) and re.search(r"^\s*100\s", proc.stdout, re.M)
    both = proc.stdout + proc.stderr
    assert "USDT" not in both and not re.search(r"\b(faster|slower)\b", both)
    assert all(len(line) <= 120 for line in both.splitlines()), both
    assert "host table" in proc.stderr  # progress, on stderr


@pytest.mark.timeout(120)
def test_bench_host_json_is_the_only_thing_on_stdout(run_cli, tmp_path: Path) -> None:
    # --from-json runs nothing: the stored result goes back out as JSON, alone on stdout.
    stored = {"schema": 1, "kind": "host", "points": [], "config": {"rounds": 24}}
    path = tmp_path / "host.json"
    path.write_text(json.dumps(stored))
    proc = run_cli(["bench", "host", "--from-json", str(path), "--json"])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == stored


def test_bench_host_refuses_a_bad_option_with_its_own_prefix(run_cli) -> None:
    proc = run_cli(["bench", "host", "--rounds", "0"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("shardscale bench host: error:")
    assert "--rounds" in proc.stderr
    proc = run_cli(["bench", "host", "--no-such-option"])
    assert proc.returncode == 2 and "usage: shardscale bench host" in proc.stderr


@pytest.mark.timeout(300)
def test_bench_scale_runs_the_clones_script(run_cli, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli(["bench", "scale", "--quick", "--out", str(out)], cwd=REPO, timeout=280.0)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "bench-scale.json").read_text())
    assert [r["world"] for r in result["rows"]] == [16, 32]
    assert all(r["host"]["clean"]["correct"] for r in result["rows"])
    assert "| 32 |" in proc.stdout


def test_bench_scale_outside_a_clone_says_what_to_run(run_cli, tmp_path: Path) -> None:
    proc = run_cli(["bench", "scale", "--quick"], cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardscale bench scale: error:"), lines
    assert "nox -s bench_scale" in lines[0] and "--repo" in lines[0]
    assert find_scale_script(None, start=tmp_path) is None
    assert find_scale_script(REPO) == REPO / "benchmarks" / "bench_scale.py"
    assert find_scale_script(None, start=REPO / "docs") == REPO / "benchmarks" / "bench_scale.py"


@pytest.mark.timeout(300)
def test_the_wheel_carries_no_simulator_and_no_nccl_model(tmp_path: Path) -> None:
    pytest.importorskip("hatchling")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
         str(tmp_path), str(REPO / "packages" / "shardscale")],
        capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = tmp_path.glob("shardscale-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "shardscale/cli/bench/_harness.py" in names  # the benchmark itself is in it
    assert not [n for n in names if any(lab in n for lab in LAB)], names
    # Nothing left in the wheel imports a private module of another distribution.
    for name in names:
        if name.endswith(".py"):
            text = zipfile.ZipFile(wheel).read(name).decode()
            private = r"^\s*(from|import) shardscale\.(fsdp|core|clip|collectives|triton)\._"
            assert not re.search(private, text, re.M), name
