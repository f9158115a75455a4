"""The scripts under examples/ run as a user would run them, and say what they promise."""

from __future__ import annotations

import os
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
