"""Telemetry over 2 real gloo ranks, turned on by SHARDSCALE_TELEMETRY alone.

Two runs, each checked against what the test computed or saw itself:

* the scaler on a small FSDP2 model in the shared 2-rank pool, with JSONL,
  TensorBoard and (offline) W&B observers on every rank (``ranks=all``),
  rank 1 poisoned at one step: every file holds one row per step whose scale
  equals ``scaler.get_scale()`` read by the test after each ``update()``, the
  poisoned step names rank 1 as the one that overflowed, and a
  ``TorchDispatchMode`` around every step sees no host read with the
  observers on (only the flushes read, one ``tolist()`` each);
* ``shardscale demo`` on 2 processes, unchanged, with the TensorBoard observer
  from the environment: tensorboard's own ``EventAccumulator`` reads exactly
  one scalar per step per tag, and the scale follows the back-off rule.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool

from shardscale.core import SkipReason
from shardscale.core.testing import HostReadRecorder

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

pytest.importorskip("tensorboard", reason="shardscale-telemetry[tensorboard] is not installed")

from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

from shardscale.telemetry import TENSORBOARD_TAGS  # noqa: E402

STEPS = 7
EVERY = 3
POISON_STEP = 2  # 0-based: the third step, on rank 1 only


def _have_wandb() -> bool:
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


def _fsdp_case(spec: str, wandb_dir: str | None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardscale import telemetry
    from shardscale.clip import unscale_and_clip_
    from shardscale.core import ShardedGradScaler

    rank = dist.get_rank()
    os.environ[telemetry.ENV] = spec
    if wandb_dir is not None:
        os.environ.update(WANDB_MODE="offline", WANDB_DIR=wandb_dir, WANDB_SILENT="true")
    telemetry.reset()  # read the variable again at the first update
    tolists: list[str] = []
    original = torch.Tensor.tolist

    def counting_tolist(self: torch.Tensor) -> Any:
        tolists.append(sys._getframe(1).f_globals["__name__"])
        return original(self)

    torch.Tensor.tolist = counting_tolist  # type: ignore[method-assign]
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # Fused: the scaler's own step makes no host read, so any read would be telemetry's.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = ShardedGradScaler("cpu", backend="c10d", init_scale=1024.0, growth_interval=2)
        out: dict[str, Any] = {"seen": [], "scales": [], "tolist_by_step": []}
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
            scaler.scale(model(x).pow(2).mean()).backward()
            if step == POISON_STEP and rank == 1:
                # After the reduce-scatter: only rank 1's shard holds the inf (a loss of inf
                # would reach every rank's shard through FSDP's gradient reduction).
                grad = model[2].weight.grad
                grad._local_tensor.view(-1)[0] = math.inf  # type: ignore[union-attr]
            before = len(tolists)
            with HostReadRecorder() as reads:
                unscale_and_clip_(scaler, opt, max_norm=0.5)
                scaler.step(opt)
                scaler.update()
            # Step 0 reads once by design: the scaler's one-time backend-chain check.
            out["seen"].append(reads.seen if step else [])
            out["tolist_by_step"].append(
                sum(c.startswith("shardscale.telemetry") for c in tolists[before:])
            )
            out["scales"].append(scaler.get_scale())  # the test's own read, after the step
        telemetry.reset()  # the end of the run: the last partial buffer is written
        out["tolist_at_close"] = sum(c.startswith("shardscale.telemetry") for c in tolists) - sum(
            out["tolist_by_step"]
        )
        return out
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]
        os.environ.pop(telemetry.ENV, None)
        telemetry.reset()


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every value
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_env_var_observers_on_fsdp2_over_two_ranks(pool2: Pool, tmp_path: Path) -> None:
    sinks = [f"jsonl:{tmp_path}/steps.{{rank}}.jsonl", f"tensorboard:{tmp_path}/tb/rank{{rank}}"]
    wandb_dir = None
    if _have_wandb():
        sinks.append("wandb:shardscale-it")
        wandb_dir = str(tmp_path / "wb")
        Path(wandb_dir).mkdir()
    spec = ",".join([*sinks, f"every={EVERY}", "ranks=all"])
    results = pool2.run(_fsdp_case, spec, wandb_dir, timeout=180)
    steps = list(range(1, STEPS + 1))
    skipped = [s == POISON_STEP + 1 for s in steps]
    for rank, res in enumerate(results):
        assert isinstance(res, dict)
        # No host read in any step with three observers on; the flushes read with tolist().
        assert res["seen"] == [[]] * STEPS, res["seen"]
        flush_steps = [s % EVERY == 0 for s in steps]
        assert res["tolist_by_step"] == [int(f) for f in flush_steps]
        assert res["tolist_at_close"] == 1  # 7 = 3 + 3 + the one left at the end
        lines = [json.loads(x) for x in (tmp_path / f"steps.{rank}.jsonl").read_text().splitlines()]
        assert [ln["step"] for ln in lines] == steps
        assert [ln["rank"] for ln in lines] == [rank] * STEPS
        assert [ln["scale"] for ln in lines] == res["scales"]
        assert [ln["skipped"] for ln in lines] == skipped
        for ln in lines:
            if ln["skipped"]:
                # Only rank 1 was poisoned; every rank knows it from the step's vector.
                assert ln["overflow_ranks"] == [1] and ln["overflow_counts"][0] >= 1
                assert ln["grad_norm"] is None  # inf, written as null
                assert ln["skip_reason"] == "overflow"  # a non-finite gradient, fp16 scaling
            else:
                assert ln["overflow_ranks"] == [] and math.isfinite(ln["grad_norm"])
                assert ln["skip_reason"] is None
        got = _scalars(tmp_path / "tb" / f"rank{rank}")
        assert set(got) == {f"shardscale/{t}" for t in TENSORBOARD_TAGS}
        for tag, values in got.items():
            assert [s for s, _ in values] == steps, tag
        assert [v for _, v in got["shardscale/scale"]] == res["scales"]
    # Both ranks recorded the same decisions.
    assert results[0]["scales"] == results[1]["scales"]  # type: ignore[index]
    if wandb_dir is not None:
        from wandb_log import history

        runs = sorted((tmp_path / "wb" / "wandb").glob("offline-run-*"))
        assert len(runs) == 2  # one run per writing rank
        for run in runs:
            rows = [r for r in history(run) if "shardscale/step" in r]
            assert [r["shardscale/step"] for r in rows] == steps
            assert [r["shardscale/scale"] for r in rows] == results[0]["scales"]  # type: ignore[index]
            assert [r["shardscale/skipped"] for r in rows] == [int(s) for s in skipped]
            overflow = int(SkipReason.OVERFLOW)
            assert [r["shardscale/skip_reason"] for r in rows] == [overflow * s for s in skipped]


def test_demo_writes_tensorboard_events_from_the_environment(tmp_path: Path) -> None:
    steps, init = 5, 2.0**20
    out, tb = tmp_path / "demo", tmp_path / "tb"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}  # fmt: skip
    env["SHARDSCALE_TELEMETRY"] = f"tensorboard:{tb},every=2"
    proc = subprocess.run(
        [sys.executable, "-m", "shardscale.cli", "demo", "--world-size", "2", "--steps",
         str(steps), "--context", "32", "--batch-size", "4", "--sample-chars", "0",
         "--device", "cpu", "--init-scale", repr(init), "--out", str(out)],
        capture_output=True, text=True, timeout=240, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Rank 0 only (the default): one event file, in the folder itself.
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1
    got = _scalars(tb)
    assert set(got) == {f"shardscale/{t}" for t in TENSORBOARD_TAGS}
    for tag, values in got.items():
        assert [s for s, _ in values] == list(range(1, steps + 1)), tag
    scales = [v for _, v in got["shardscale/scale"]]
    skipped = [bool(v) for _, v in got["shardscale/skipped"]]
    # The demo's high initial scale overflows fp16 at first; with growth_interval 20 the scale
    # can only halve on a skipped step and stay put otherwise.
    assert skipped[0]
    previous = init
    for scale, skip in zip(scales, skipped, strict=True):
        assert scale == (previous / 2 if skip else previous)
        previous = scale
    # The demo's own steps.jsonl (its JSONL observer) and metrics.json agree with the events.
    lines = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert [ln["scale"] for ln in lines] == scales and [ln["skipped"] for ln in lines] == skipped
    history = json.loads((out / "metrics.json").read_text())["history"]
    # metrics.json keeps the scale each step ran with: the one before its update.
    assert [h["scale"] for h in history] == [init, *scales[:-1]]
