"""The scripts under examples/ run as a user would run them, and say what they promise."""

from __future__ import annotations

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
