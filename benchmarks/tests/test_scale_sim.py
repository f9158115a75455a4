"""The scale simulation: the real engine on torch's fake process group, and the NCCL model.

The timed table (up to 131 072 ranks) is ``nox -s bench_scale``; these tests run the same
simulation at a few world sizes up to 16 384 and check its claims: that the composed reduced
vector is the SUM a real group would return, and that every simulated rank decides correctly.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from nccl_model import Fabric, allreduce_us, predict
from scale_sim import (
    SCALE,
    TEMPLATE_RANK,
    SimBackend,
    SimConfig,
    _params,
    _step,
    compose,
    fake_rank,
    local_grads,
    representative_ranks,
    simulate,
)


@pytest.mark.parametrize("world", [8, 16])
@pytest.mark.parametrize("inf_on_last", [False, True])
def test_composed_vector_is_the_sum_over_every_rank(world: int, inf_on_last: bool) -> None:
    # Run the engine at EVERY rank of a small fake group and add up what each hands to the
    # all-reduce: the composition from three representatives and a template must equal it.
    from shardscale.core import get_registry

    cfg = SimConfig(world=world, inf_on_last=inf_on_last, repeats=1)
    seen: dict[int, torch.Tensor] = {}
    for rank in range(world):
        with fake_rank(rank, world) as mesh:
            backend = SimBackend(get_registry().make_backend("c10d"))
            _step(_params(rank, cfg, mesh), backend, cfg)
            assert backend.seen is not None
            seen[rank] = backend.seen
    total = torch.stack(list(seen.values())).sum(dim=0)
    picked = {r: seen[r] for r in (*representative_ranks(world), TEMPLATE_RANK)}
    # Exact: every slot is written by one rank (others add zeros) and the shared counts are
    # small integers, so the float64 sums have no rounding in either order.
    assert torch.equal(compose(picked, world), total)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1024, 16384])
def test_decisions_at_scale(world: int) -> None:
    clean = simulate(SimConfig(world=world, repeats=1))
    # Independent float64 reference: every rank's squared local norms, replicas once.
    reps = representative_ranks(world)

    def sq(tensors: list[torch.Tensor]) -> float:
        return sum(float(t.double().pow(2).sum()) for t in tensors)

    total = (world - len(reps)) * sq(local_grads(TEMPLATE_RANK, SimConfig(world=world))[0])
    total += sum(sq(local_grads(r, SimConfig(world=world))[0]) for r in reps)
    total += sq(local_grads(0, SimConfig(world=world))[1])
    want = math.sqrt(total) / SCALE
    assert set(clean.decisions) == set(reps)
    for found, norm in clean.decisions.values():
        assert found == 0.0
        # Tolerance: float32 per-tensor accumulation over 8 elements, float64 combination,
        # float32 result (norm_rtol in _scale_sim states the bound).
        assert norm == pytest.approx(want, rel=clean.rtol, abs=0.0)
    assert len(set(clean.decisions.values())) == 1

    overflow = simulate(SimConfig(world=world, repeats=1, inf_on_last=True))
    for found, norm in overflow.decisions.values():
        assert found == 1.0
        assert math.isinf(norm) and norm > 0
    assert overflow.correct and clean.correct
    # The step's one collective, at every size, clean or not.
    assert clean.collectives_per_step == 1.0 and overflow.collectives_per_step == 1.0


def test_nccl_model_small_messages_take_the_tree() -> None:
    # 1 024 ranks = 128 nodes of 8: tree/LL, NCCL's defaults: base 6.8 µs, NVLink hop 0.6 µs,
    # network hop 5.0 µs: 6.8 + 2 * (7 * 0.6 + log2(128) * 5.0) = 85.2 µs, plus 8 bytes at
    # LL's 10.2 GB/s (20.4 capped, halved for the tree's two passes): ~0.0008 µs.
    t = allreduce_us(8, 1024)
    assert (t.algo, t.proto) == ("tree", "LL")
    assert t.us == pytest.approx(85.2 + 8 / (1000 * 10.2), rel=1e-6)


def test_nccl_model_large_messages_on_few_nodes_take_the_ring() -> None:
    # 1 GiB over 2 nodes: bandwidth-bound, where NCCL's tuner picks the ring.
    assert allreduce_us(2**30, 16).algo == "ring"


def test_nccl_model_grows_with_bytes_and_ranks() -> None:
    for world in (1024, 16384, 131072):
        times = [allreduce_us(n, world).us for n in (8, 2**12, 2**16, 2**20, 2**24)]
        assert times == sorted(times)
    assert allreduce_us(8, 1024).us < allreduce_us(8, 131072).us
    # A slower network makes a megabyte dearer, never cheaper.
    assert (
        allreduce_us(2**22, 65536, Fabric(bw_inter_per_channel=12.5)).us
        > allreduce_us(2**22, 65536).us
    )


def test_nccl_model_refuses_partial_nodes() -> None:
    with pytest.raises(ValueError, match="whole nodes of 8"):
        predict(8, 12)


def _run(args: list[str], *, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    script = Path(__file__).resolve().parents[1] / "bench_scale.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def test_scale_command_writes_the_table(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run(["--worlds", "16", "32", "--repeats", "2", "--out", str(out)], timeout=240.0)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "bench-scale.json").read_text())
    assert [r["world"] for r in result["rows"]] == [16, 32]
    for row in result["rows"]:
        assert row["host"]["clean"]["correct"] and row["host"]["inf_on_last"]["correct"]
        assert len(row["host"]["clean"]["samples_ms"]) == 2 * len(representative_ranks(16))
        assert row["model_derived"]["ratio"] >= 1.0
        assert row["host"]["clean"]["collectives_per_step"] == 1.0
    assert "| 32 |" in (out / "bench-scale.md").read_text()


def test_scale_command_refuses_bad_worlds() -> None:
    proc = _run(["--worlds", "12"])
    assert proc.returncode == 2
    assert "whole nodes of 8" in proc.stderr
