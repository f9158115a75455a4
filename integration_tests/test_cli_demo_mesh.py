"""``shardscale demo --mesh 2x2``: FSDP x tensor parallel over 4 processes, through a backend chain.

The 2x2 run and a plain FSDP run over 2 ranks see the same global batch at
step 1 (data is drawn per data-parallel coordinate), from the same initial
weights. So their first loss and their first gradient norm must agree up to
fp16 rounding. A norm that double-counted the parameters TP leaves whole
(embeddings, norms, head: replicated over the tp ranks) would be far larger.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

# A modest --init-scale: the demo's default overflows on purpose at step 1, and this test
# compares the first step's (finite) gradient norms.
SMALL = ["--steps", "2", "--context", "32", "--batch-size", "4", "--sample-chars", "0",
         "--device", "cpu", "--init-scale", "1024"]  # fmt: skip


def _demo(out: Path, *extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "shardscale.cli", "demo", *SMALL, "--out", str(out), *extra],
        capture_output=True, text=True, timeout=280, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "metrics.json").read_text())


def test_fsdp_tp_mesh_trains_together_and_norm_matches_plain_fsdp(tmp_path: Path) -> None:
    tp = _demo(tmp_path / "tp", "--mesh", "2x2", "--backend", "counting+c10d")
    assert tp["run"]["world_size"] == 4 and tp["run"]["mesh"] == "2x2"
    assert tp["run"]["backend"] == "counting+c10d"
    hashes = {json.loads((tmp_path / "tp" / f"result-rank{r}.json").read_text())["params_sha256"]
              for r in range(4)}  # fmt: skip
    assert len(hashes) == 1, "the four ranks ended with different parameters"

    fsdp = _demo(tmp_path / "fsdp", "--world-size", "2")
    assert fsdp["run"]["mesh"] == "2"
    first_tp, first_fsdp = tp["history"][0], fsdp["history"][0]
    assert first_tp["loss"] == pytest.approx(first_fsdp["loss"], rel=1e-3)
    assert first_tp["grad_norm"] == pytest.approx(first_fsdp["grad_norm"], rel=1e-3)
    # After one clipped update the runs still agree: the clip coefficient was the same.
    assert tp["history"][1]["loss"] == pytest.approx(fsdp["history"][1]["loss"], rel=1e-3)


def test_pipeline_mesh_trains_together_and_matches_plain_fsdp(tmp_path: Path) -> None:
    """``--mesh pp2xdp2``: 2 pipeline stages x FSDP 2 in fp16 against FSDP over 2 ranks.

    Both see the same data per data-parallel coordinate and start from the same
    weights, so the first loss and the first (clipped-by) norm must agree up to
    fp16 rounding: a norm missing a stage, or counting one twice, would not.
    Only the last stage scales the loss; the first stage's scaler never does.
    """
    pp = _demo(tmp_path / "pp", "--mesh", "pp2xdp2", "--backend", "counting+c10d")
    assert pp["run"]["world_size"] == 4 and pp["run"]["mesh"] == "pp2xdp2"
    hashes = {json.loads((tmp_path / "pp" / f"result-rank{r}.json").read_text())["params_sha256"]
              for r in range(4)}  # fmt: skip
    assert len(hashes) == 1, "the stages assembled different models"
    fsdp = _demo(tmp_path / "fsdp", "--world-size", "2")
    first_pp, first_fsdp = pp["history"][0], fsdp["history"][0]
    assert first_pp["loss"] == pytest.approx(first_fsdp["loss"], rel=1e-3)
    assert first_pp["grad_norm"] == pytest.approx(first_fsdp["grad_norm"], rel=1e-3)
    assert pp["history"][1]["loss"] == pytest.approx(fsdp["history"][1]["loss"], rel=1e-3)
