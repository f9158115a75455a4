"""``shardscale bench --policies --quick`` end to end on 2 gloo ranks, and what it writes.

No speed is asserted: timings are only checked to exist and the intervals to
hold their ratio. What is asserted is what the policies must not change: one
collective per step for every arm, and no step skipped on clean data.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from shardscale.cli.bench._policies import POLICY_ARMS


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_quick_policies_run_measures_every_arm_with_one_collective(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "shardscale.cli", "bench", "--policies", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "bench-policies.json").read_text())
    assert result["kind"] == "policies" and result["environment"]["world_size"] == 2
    assert list(result["arms"]) == list(POLICY_ARMS)
    # 7 arms: a balanced cycle is 14 rounds (odd count: each row also reversed).
    assert result["rounds"] % 14 == 0
    for name, arm in result["arms"].items():
        assert len(arm["post_ms"]) == len(arm["step_ms"]) == result["rounds"]
        assert all(math.isfinite(t) and t > 0 for t in arm["step_ms"])
        # Every policy rides in the step's one all-reduce; clean data skips nothing.
        assert arm["collectives"] == 1, name
        assert arm["skipped_after"] is False, name
        if name != "none":
            for metric in ("post", "step"):
                r = arm[f"{metric}_ratio"]
                assert r["low"] <= r["ratio"] <= r["high"] and r["paired"], (name, r)
    assert "no policy again (A/A)" in proc.stdout and "collectives / step" in proc.stdout
    md = (out / "bench-policies.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(POLICY_ARMS)  # header, separator, one row per arm
    # --from-json reprints it, Markdown included, without running anything.
    again = subprocess.run(
        [sys.executable, "-m", "shardscale.cli", "bench", "--from-json",
         str(out / "bench-policies.json"), "--markdown"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert again.returncode == 0 and again.stdout.strip() == md.strip(), again.stderr


def test_policies_refuse_the_scaling_options(tmp_path: Path) -> None:
    from shardscale.cli._app import main

    for extra in (["--scaling-only"], ["--scaling-points", "8"]):
        assert main(["bench", "--policies", *extra, "--out", str(tmp_path / "b")]) == 2
    assert not (tmp_path / "b").exists()
