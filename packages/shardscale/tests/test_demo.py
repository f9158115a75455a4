"""``shardscale demo`` trains for real: 2 gloo processes, FSDP2, fp16, the loss falls, a PNG appears."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from shardscale.cli._ui import have_matplotlib

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Small windows keep the run short on 2 shared cores; the model is the demo's own.
FAST = ["--context", "64", "--batch-size", "8", "--sample-chars", "0"]


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_demo_loss_falls_and_plot_exists(run_cli, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # Left-overs of an earlier, bigger run in the same folder must not survive into this one.
    (out / "logs").mkdir(parents=True)
    for stale in ("result-rank3.json", "metrics.json", "training.png", "logs/rank3.log"):
        (out / stale).write_text("stale")
    (out / "notes.txt").write_text("mine")
    proc = run_cli(["demo", "--steps", "10", "--out", str(out), "--device", "cpu", *FAST],
                   timeout=200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.glob("result-rank*.json")) == [
        "result-rank0.json", "result-rank1.json"
    ]  # fmt: skip
    assert not (out / "logs" / "rank3.log").exists() and (out / "notes.txt").read_text() == "mine"
    metrics = _read(out / "metrics.json")
    losses = [h["loss"] for h in metrics["history"]]
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses)
    # Character-level text starts near ln(vocab) and must drop well below it within a few steps.
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.4, f"loss did not fall: {losses}"
    assert metrics["run"]["world_size"] == 2 and metrics["run"]["precision"] == "fp16"
    # The plot exists, is a PNG, and its path was printed (without the ui extra: the hint instead).
    png = out / "training.png"
    if have_matplotlib():
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert str(png) in proc.stdout
    else:
        assert not png.exists() and "pip install 'rich>=13' 'matplotlib>=3.7'" in proc.stdout
    # Both FSDP ranks ended with the same full parameters (they trained one model together).
    r0, r1 = _read(out / "result-rank0.json"), _read(out / "result-rank1.json")
    assert (r0["rank"], r1["rank"]) == (0, 1)
    assert r0["params_sha256"] == r1["params_sha256"]
    assert r0["final_loss"] == r1["final_loss"] == losses[-1]
    # Per-step progress was shown (plain lines: the output is not a terminal) and the summary.
    assert "step    10/10" in proc.stdout
    assert "shardscale demo: summary" in proc.stdout and "loss: first -> last" in proc.stdout
    for h in metrics["history"]:
        assert h["scale"] > 0 and isinstance(h["skipped"], bool)
        # A skipped step is one whose gradients overflowed: its norm is inf/nan (stored as null).
        assert (h["grad_norm"] is None) == h["skipped"], h
    # The default initial scale is high on purpose: fp16 gradients really overflow at first,
    # each overflow skips the step and halves the scale for the next one.
    history = metrics["history"]
    assert history[0]["skipped"], "the first fp16 step at the default scale should overflow"
    for before, after in itertools.pairwise(history):
        if before["skipped"]:
            assert after["scale"] == before["scale"] / 2, (before, after)
    assert metrics["summary"]["scale_backoffs"] >= metrics["summary"]["skipped_steps"] >= 1
    assert "backoffs" in proc.stdout and "demo wall time:" in proc.stdout
    # Overflow localisation on the first real skip: the ranks and the parameters by name.
    report = metrics["summary"]["first_overflow"]
    assert "skipped (overflow): non-finite gradients on rank(s)" in report, report
    assert ".weight" in report and report in proc.stdout, report
    # Every skipped step says why: fp16 overflow, counted by reason in the summary.
    assert [h["skip_reason"] for h in history] == [
        "overflow" if h["skipped"] else None for h in history
    ]
    skipped = metrics["summary"]["skipped_steps"]
    assert metrics["summary"]["skip_reasons"] == {"overflow": skipped}
    assert f"({skipped}: {skipped} overflow)" in proc.stdout


SPIKE_AT = 30  # after the spike window armed (24 accepted steps)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_bf16_without_loss_scaling_skips_an_injected_spike_on_every_rank(
    run_cli, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    proc = run_cli(["demo", "--steps", "32", "--out", str(out), "--device", "cpu", "--precision",
                    "bf16", "--spike", "--inject-spike", str(SPIKE_AT), *FAST], timeout=200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = _read(out / "metrics.json")
    history = metrics["history"]
    # bf16 runs with loss_scaling=False: the scale stays 1, nothing overflows, and the one step
    # whose loss rank 0 multiplied by 1e3 (a finite norm far above the window) is the one skip.
    assert {h["scale"] for h in history} == {1.0}
    assert [h["step"] for h in history if h["skipped"]] == [SPIKE_AT]
    assert history[SPIKE_AT - 1]["skip_reason"] == "spike"
    assert metrics["summary"]["skip_reasons"] == {"spike": 1}
    assert "(1: 1 spike)" in proc.stdout
    # The report of the first skipped step names the reason; a spike's gradients were finite.
    report = metrics["summary"]["first_overflow"]
    assert report == f"step {SPIKE_AT} skipped (spike): no non-finite gradients", report
    assert report in proc.stdout
    r0, r1 = _read(out / "result-rank0.json"), _read(out / "result-rank1.json")
    assert r0["params_sha256"] == r1["params_sha256"] and r0["skipped_steps"] == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_misspelt_telemetry_variable_does_not_stop_the_demo(run_cli, tmp_path: Path) -> None:
    # The variable turns off its own session only: the demo's sessions (its progress rows and
    # steps.jsonl) keep every step, and the rank's log names the variable and the fix.
    out = tmp_path / "run"
    proc = run_cli(["demo", "--world-size", "1", "--steps", "3", "--out", str(out),
                    "--device", "cpu", *FAST],
                   env={"SHARDSCALE_TELEMETRY": f"tensorbord:{tmp_path}/tb"}, timeout=200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [json.loads(x)["step"] for x in (out / "steps.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert [h["step"] for h in _read(out / "metrics.json")["history"]] == [1, 2, 3]
    log = (out / "logs" / "rank0.log").read_text()
    assert "unknown observer 'tensorbord'" in log and "correct SHARDSCALE_TELEMETRY" in log
    assert not (tmp_path / "tb").exists()


def test_demo_without_rich_and_matplotlib_still_trains(run_cli, tmp_path: Path) -> None:
    out = tmp_path / "plain"
    hide = "import sys\nsys.modules['rich'] = None\nsys.modules['matplotlib'] = None"
    proc = run_cli(["demo", "--steps", "2", "--out", str(out), "--device", "cpu", *FAST],
                   prelude=hide, timeout=200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pip install 'rich>=13' 'matplotlib>=3.7'" in proc.stdout
    assert (out / "metrics.json").exists()
    assert not (out / "training.png").exists()
    assert "no plot: matplotlib is not installed" in proc.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_timeout_stops_every_rank_and_says_what_to_try(run_cli, tmp_path: Path) -> None:
    out = tmp_path / "slow"
    proc = run_cli(["demo", "--timeout", "3", "--out", str(out), "--device", "cpu"], timeout=100)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("shardscale demo: error:")]
    assert "did not finish in 3 s (--timeout)" in line
    # Where the ranks were, and the levers: fewer steps, bf16, a longer timeout.
    assert "rank 0" in line and "rank 1" in line
    assert "--steps" in line and "--precision bf16" in line and "--timeout 9" in line
    assert not (out / "metrics.json").exists()


def test_unknown_backend_fails_before_starting_processes(run_cli, tmp_path: Path) -> None:
    out = tmp_path / "bad"
    proc = run_cli(["demo", "--backend", "no-such-backend", "--out", str(out)], timeout=60)
    assert proc.returncode == 2
    assert "no backend named 'no-such-backend'" in proc.stderr and "local" in proc.stderr
    assert not (out / "logs").exists()


def test_mesh_that_does_not_fit_world_size_is_refused(run_cli, tmp_path: Path) -> None:
    proc = run_cli(["demo", "--mesh", "2x2", "--world-size", "2", "--out", str(tmp_path)],
                   timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert "needs 4 processes" in proc.stderr and "--world-size 4" in proc.stderr


def test_bad_precision_is_refused_by_argparse(run_cli, tmp_path: Path) -> None:
    proc = run_cli(["demo", "--precision", "fp8", "--out", str(tmp_path)], timeout=60)
    assert proc.returncode == 2 and "fp8" in proc.stderr


def test_cuda_without_gpu_is_refused_with_a_fix(run_cli, tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = run_cli(["demo", "--device", "cuda", "--out", str(tmp_path)], timeout=60)
    assert proc.returncode == 2 and "--device cpu" in proc.stderr


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_demo_on_cuda_uses_nccl_and_the_gpu(run_cli, tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    out = tmp_path / "cuda"
    proc = run_cli(["demo", "--device", "cuda", "--world-size", "1", "--steps", "10",
                    "--out", str(out), *FAST], timeout=280)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NCCL" in proc.stdout
    metrics = _read(out / "metrics.json")
    assert metrics["run"]["device"].startswith("cuda")
    losses = [h["loss"] for h in metrics["history"]]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.4
