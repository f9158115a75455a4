"""The scripts under examples/ run as a user would run them, and say what they promise."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(180)
def test_single_process_example_matches_torch_bit_for_bit() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "single_process.py")],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical parameters and scale: True" in proc.stdout


def _run_example(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_pipeline_example_agrees_on_every_stage() -> None:
    """4 CPU processes: 2 pipeline stages x 2 FSDP2 replicas, fp16, an overflow on stage 0."""
    out = _run_example(str(ROOT / "examples" / "pipeline_fp16.py"))
    assert "every stage and replica: same norms, scales and skips: True" in out
    assert "step 3: norm inf" in out and "skipped True" in out


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("style", ["dtensor", "plain"])
def test_moe_example_agrees_on_every_rank(style: str) -> None:
    """4 CPU processes: experts over an EP mesh (DTensor) or per rank (plain), fp16."""
    out = _run_example(str(ROOT / "examples" / "moe_fp16.py"), "--style", style)
    assert f"[{style}] every rank: same norms, scales and skips: True" in out
    assert "step 3: norm inf" in out


_STEP = re.compile(
    r"^step +(?P<step>\d+)  loss (?P<loss>\S+)  norm (?P<norm>\S+)  next scale (?P<scale>\d+)  "
    r"skipped: (?P<reason>\w+)$"
)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_fsdp2_example_under_torchrun() -> None:
    """``torchrun --nproc-per-node 2 examples/fsdp2_fp16.py`` (gloo here): what getting-started runs.

    The scale starts at 2**24 on purpose, so the first steps overflow fp16 for real: they must
    be skipped with the scale halved each time and the parameters untouched (the loss repeats),
    then every later step taken with a finite norm and the loss falling; both ranks end with
    bit-identical parameters.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples" / "fsdp2_fp16.py")],
        capture_output=True, text=True, timeout=230, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [m.groupdict() for m in map(_STEP.match, proc.stdout.splitlines()) if m]
    assert [int(r["step"]) for r in rows] == list(range(30)), proc.stdout
    skipped = [r for r in rows if r["reason"] != "none"]
    taken = [r for r in rows if r["reason"] == "none"]
    assert skipped and all(r["reason"] == "overflow" for r in skipped)
    assert rows[: len(skipped)] == skipped  # the overflows are the first steps, then none
    # Each skip halves the scale (backoff 0.5) from 2**24; nothing moves, so the loss repeats.
    assert [int(r["scale"]) for r in skipped] == [2**24 >> (i + 1) for i in range(len(skipped))]
    assert len({r["loss"] for r in skipped} | {taken[0]["loss"]}) == 1
    assert all(math.isfinite(float(r["norm"])) for r in taken)
    assert not any(math.isfinite(float(r["norm"])) for r in skipped)
    assert len(taken) >= 15 and float(taken[-1]["loss"]) < float(taken[0]["loss"]) / 4
    assert "2 ranks, same parameters: True" in proc.stdout
