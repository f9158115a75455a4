"""The demo's training script under real ``torchrun``: two "nodes" on 127.0.0.1, c10d rendezvous.

Each node is a separate ``torchrun`` process (``--nnodes 2 --nproc-per-node 1``),
exactly the commands the docs show for a multi-node run, with 127.0.0.1
standing in for the first node's address. They must find each other through
the c10d rendezvous, train one model together, and end with identical full
parameters (each rank hashes the gathered parameters into its result file).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

# Tiny windows: the point is the launch and the agreement, not the loss.
TRAIN_ARGS = ["--steps", "4", "--context", "32", "--batch-size", "2", "--sample-chars", "0",
              "--device", "cpu", "--progress", "plain"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun() -> list[str]:
    script = Path(sys.executable).parent / "torchrun"
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "TORCHELASTIC_RUN_ID", "SHARDSCALE_BACKEND")}  # fmt: skip
    env["OMP_NUM_THREADS"] = "1"
    return env


def _start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    # A session of its own, so a hung run is stopped with every worker torchrun started.
    with open(log, "wb") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(),
                                start_new_session=True)  # fmt: skip


def _wait_all(procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun did not finish in {timeout:.0f} s; logs:\n" + _logs(logs))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _logs(logs: list[Path]) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in logs)


def test_two_torchrun_nodes_train_together(tmp_path: Path) -> None:
    port = _free_port()
    out = tmp_path / "out"
    procs, logs = [], []
    for node_rank in (0, 1):
        cmd = [*_torchrun(), "--nnodes", "2", "--node-rank", str(node_rank),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"shardscale-{port}",
               "--local-addr", "127.0.0.1", "--max-restarts", "0",
               "-m", "shardscale.cli.train", *TRAIN_ARGS, "--out", str(out)]  # fmt: skip
        logs.append(tmp_path / f"node{node_rank}.log")
        procs.append(_start(cmd, logs[-1]))
    _wait_all(procs, logs, timeout=360)
    assert [p.returncode for p in procs] == [0, 0], _logs(logs)
    results = [json.loads((out / f"result-rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 and r["launcher"] == "torchrun" for r in results)
    assert all(r["steps"] == 4 for r in results)
    # One model, trained by both: the same full parameters and the same (all-reduced) loss.
    assert results[0]["params_sha256"] == results[1]["params_sha256"]
    assert results[0]["final_loss"] == results[1]["final_loss"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["run"]["launcher"] == "torchrun" and len(metrics["history"]) == 4


def test_single_node_torchrun_and_doctor_connect(tmp_path: Path) -> None:
    log = tmp_path / "doctor.log"
    cmd = [*_torchrun(), "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
           "-m", "shardscale.cli", "doctor", "--connect", "--backend", "counting+c10d"]  # fmt: skip
    proc = _start(cmd, log)
    _wait_all([proc], [log], timeout=240)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text
    assert text.count("all-reduced across 2 ranks") == 2, text
    assert "rank 0 of 2" in text and "rank 1 of 2" in text
