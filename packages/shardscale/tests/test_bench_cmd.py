"""``shardscale bench --quick`` end to end on 2 gloo ranks, and what it writes.

No test here asserts a speed: timings are only checked to exist. The counts
are checked against hand counts for the tiny model (width 32, hidden 64, one
block): 2*32*64 + 64 + 32 = 4192 float32 parameters, half on each of the 2
ranks of the 1-D mesh, so G = 2096 * 4 = 8384 bytes of local gradient.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shardscale.cli._ui import have_matplotlib
from shardscale.cli.bench import write_json

G = (2 * 32 * 64 + 64 + 32) // 2 * 4
QUICK = ["bench", "--quick", "--meshes", "dp2", "--scaling-points", "8,16"]

# (optimizer, arm) -> (read, written) of post-processing + step, in units of G:
# torch: unscale R+W, norm R, clip R+W, the optimizer's read R (fused Adam without grad_scale
# leaves the grads alone); ours: statistics R, then the multiply R+W and SGD's read R (the
# default steps the foreach SGD as built), or fused Adam's R+W (it divides by grad_scale and
# stores the gradient back); ours_fuse_optimizer: the foreach SGD's step through torch's fused
# kernel too, R+W; streaming moves the statistics read into backward hooks (counted apart).
EXPECTED = {
    ("sgd", "torch"): (4, 2), ("sgd", "torch_aa"): (4, 2), ("sgd", "ours"): (3, 1),
    ("sgd", "ours_fuse_optimizer"): (2, 1), ("sgd", "ours_streaming"): (2, 1),
    ("adam_fused", "torch"): (4, 2), ("adam_fused", "torch_aa"): (4, 2),
    ("adam_fused", "ours"): (2, 1), ("adam_fused", "ours_fuse_optimizer"): (2, 1),
    ("adam_fused", "ours_streaming"): (1, 1),
}  # fmt: skip
# Where the kernel takes grad_scale (fused Adam; the foreach SGD with fuse_optimizer=True) it
# reads each gradient and writes it back unscaled, no multiply pass.
# Passes over gradients + parameters + optimizer state (the optimizer's own: SGD reads the grad
# and reads+writes the parameter, 3; fused Adam also reads+writes both moments, 7): the
# gradient passes above, plus 2 (SGD) or 6 (Adam) state passes.
STATE = {"sgd": 2, "adam_fused": 6}


@pytest.fixture(scope="module")
def quick_run_output(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("bench")
    # An earlier run's files: the new run must replace them, never sit beside them.
    (out / "bench.json").write_text('{"stale": true}')
    (out / "bench.png").write_bytes(b"stale")
    # On a pipe, as in a CI log: plain text, no bars.
    proc = subprocess.run(
        [sys.executable, "-m", "shardscale.cli", *QUICK, "--out", str(out)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def quick_run(quick_run_output: tuple[Path, str, str]) -> tuple[Path, str]:
    return quick_run_output[0], quick_run_output[1]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_quick_run_measures_every_arm(quick_run: tuple[Path, str]) -> None:
    out, stdout = quick_run
    result = json.loads((out / "bench.json").read_text())
    assert "stale" not in result
    env = result["environment"]
    assert env["world_size"] == 2 and env["torch_num_threads"] >= 1 and env["cpu_count"] >= 1
    assert [(r["mesh"], r["optimizer"]) for r in result["rows"]] == [
        ("dp2", "sgd"),
        ("dp2", "adam_fused"),
    ]
    for row in result["rows"]:
        assert row["mesh_shape"] == [2] and row["local_grad_bytes"] == G
        # The smoke run leaves ours_fuse_optimizer out (test_the_full_run_has_both_ours_arms).
        assert set(row["arms"]) == {"torch", "torch_aa", "ours", "ours_streaming"}
        for name, arm in row["arms"].items():
            assert len(arm["step_ms"]) == row["rounds"] >= 4
            assert all(s > 0 for s in arm["step_ms"] + arm["post_ms"])
            want = EXPECTED[(row["optimizer"], name)]
            assert (arm["grad_bytes_read"], arm["grad_bytes_written"]) == (want[0] * G, want[1] * G)
            assert arm["passes_derived"] == want[0] + want[1] + STATE[row["optimizer"]]
            assert isinstance(arm["pass_floor"], int) and 0 < arm["pass_floor_ratio"] <= 1
            # On the CPU the launch counter counts dispatched ops; there are no syncs to check.
            assert arm["launches_post"] > 0 and "aten ops" in arm["launches_counted_as"]
            assert arm["host_sync_clip"] == arm["host_sync_post"] == "n/a"
            hooks = G if name == "ours_streaming" else 0
            assert arm["grad_bytes_read_in_backward_hooks"] == hooks
            if name.startswith("ours"):
                assert arm["collectives_counting_middleware"] == arm["collectives"] == 1
            else:
                assert arm["collectives_comm_debug_mode"] == arm["collectives"] >= 2
                assert arm["collectives_counted_with"] == "CommDebugMode"
            if name != "torch":
                # 4 rounds: the interval is there, the verdict is withheld (too few rounds).
                r = arm["ratio"]["step"]
                assert r["low"] <= r["high"] and r["samples"] == row["rounds"]
                assert r["verdict"] == "too few rounds for a verdict"
        assert row["aa"] == row["arms"]["torch_aa"]["ratio"]
        assert set(row["streaming_vs_ours"]) == {"step", "post", "backward"}
    points = result["scaling"]["points"]
    assert [p["n_params"] for p in points] == [8, 16]
    for p in points:
        for arm in ("torch", "ours"):
            cold = p["arms"][arm]["cold_s"]
            assert len(cold) >= 3 and p["arms"][arm]["cold"]["min"] == min(cold)
    for word in ("A/A", "torch again (A/A)", "ours + streaming / ours", "scaling", "derived",
                 "6.0 (floor 6 -> 0.75)", "9.0 (floor 8 -> 0.67)", "Launches per post-processing",
                 str(out / "bench.json")):  # fmt: skip
        assert word in stdout
    if have_matplotlib():
        assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not (out / "bench.png").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_markdown_is_regenerated_from_the_json(
    quick_run: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from shardscale.cli._app import main

    out, _ = quick_run
    assert main(["bench", "--from-json", str(out / "bench.json"), "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == (out / "bench.md").read_text().strip()
    # Several runs: the first run's table, then the ranges over all of them.
    other = json.loads((out / "bench.json").read_text())
    other["started"] = "another run"
    write_json(other, out / "other.json")
    assert main(["bench", "--from-json", str(out / "bench.json"), str(out / "other.json")]) == 0
    printed = capsys.readouterr().out
    assert "Ranges over 2 runs" in printed and "another run" in printed
    # --json: the result as JSON, alone on stdout.
    assert main(["bench", "--from-json", str(out / "bench.json"), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["rows"] == json.loads((out / "bench.json").read_text())["rows"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_quick_output_on_a_pipe_is_quiet_narrow_and_makes_no_claims(
    quick_run_output: tuple[Path, str, str],
) -> None:
    import re

    _, stdout, stderr = quick_run_output
    both = stdout + stderr
    # No profiler lines (kineto's "USDT: ... profiler_start"), no rank's stray output.
    assert "USDT" not in both and "profiler_start" not in both and "STAGE:" not in both, both
    for line in both.splitlines():
        assert len(line) <= 120, (len(line), line)
    assert "smoke run: too few rounds for verdicts" in stdout
    assert "smoke run: too few rounds for verdicts" in stderr
    assert not re.search(r"\b(faster|slower)\b", both), both
    # The launches block is a table with a header row, not ;-separated cells.
    lines = stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Launches per post-processing"))
    header = next(ln for ln in lines[start:] if ln.startswith("mesh, optimizer / arm"))
    assert "launches" in header and "host sync in clip" in header
    assert not any(";" in ln and "n/a" in ln for ln in lines)
    # Progress: plain lines on stderr (a pipe), what runs and an estimate; no carriage returns.
    assert "timed rounds" in stderr and "left)" in stderr and "scaling table" in stderr
    assert "\r" not in stderr and "\x1b[" not in stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_chart_draws_the_intervals_whole_counts_and_the_runs_kind(
    quick_run: tuple[Path, str],
) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.container import BarContainer

    from shardscale.cli._bench_cmd import bench_figure

    out, _ = quick_run
    result = json.loads((out / "bench.json").read_text())
    fig = bench_figure(result)
    try:
        title = fig._suptitle.get_text()
        # 4192 parameters read as 4.19k, not "0.00419M"; a 4-round run says it is a smoke run.
        assert "4.19k params" in title and "smoke run" in title, title
        step_ax, post_ax, coll_ax = fig.axes
        for ax, metric in ((step_ax, "step"), (post_ax, "post")):
            bars = [c for c in ax.containers if isinstance(c, BarContainer)]
            assert [c.get_label() for c in bars] == [
                "torch", "torch again (A/A)", "ours", "ours + streaming stats"
            ]  # fmt: skip
            for container, arm in zip(bars, ["torch", "torch_aa", "ours", "ours_streaming"],
                                      strict=True):  # fmt: skip
                assert container.errorbar is not None, (metric, arm)
                segments = container.errorbar.lines[2][0].get_segments()
                if arm == "torch":  # the reference: no interval drawn
                    assert all(len(seg) == 0 or math.isnan(seg[0][1]) for seg in segments)
                    continue
                assert len(segments) == len(result["rows"])
                for seg, row in zip(segments, result["rows"], strict=True):
                    (_, low), (_, high) = seg
                    want = row["arms"][arm]["ratio"][metric]
                    assert low == pytest.approx(want["low"]), (metric, arm)
                    assert high == pytest.approx(want["high"]), (metric, arm)
        ticks = [
            t for t in coll_ax.get_yticks() if coll_ax.get_ylim()[0] <= t <= coll_ax.get_ylim()[1]
        ]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        assert all(c.errorbar is None for c in coll_ax.containers)  # counts have no interval
    finally:
        plt.close(fig)


def test_non_finite_numbers_are_written_as_null(tmp_path: Path) -> None:
    path = write_json(
        {"a": math.nan, "b": [math.inf, 1.5], "c": {"d": -math.inf}}, tmp_path / "x.json"
    )
    assert json.loads(path.read_text()) == {"a": None, "b": [None, 1.5], "c": {"d": None}}


def test_the_full_run_has_both_ours_arms() -> None:
    # ours with the default (the optimizer stepped as built) and with fuse_optimizer=True side
    # by side in every full run's table; their pass counts are held against hand counts in
    # test_bench_passes.py.
    from shardscale.cli.bench._config import BenchConfig, quick
    from shardscale.cli.bench._report import _LABEL

    arms = BenchConfig().arms()
    assert arms[arms.index("ours") + 1] == "ours_fuse_optimizer"
    assert _LABEL["ours_fuse_optimizer"] == "ours, fuse_optimizer=True"
    assert "ours_fuse_optimizer" not in quick(BenchConfig()).arms()
