"""The benchmark's launch counter and host-sync check: on CPU ops here, on CUDA where there is one."""

from __future__ import annotations

import pytest
import torch

from shardscale.cli.bench._config import BenchConfig
from shardscale.cli.bench._launches import count_launches, host_sync

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _tensors(device: str = "cpu") -> list[torch.Tensor]:
    return [torch.ones(5, device=device) * (i + 1) for i in range(3)]


def test_cpu_counts_top_level_ops_not_the_ops_they_call() -> None:
    ts = _tensors()
    # One multi-tensor op (it calls mul_ per tensor inside), then three single-tensor ops.
    assert count_launches(lambda: torch._foreach_mul_(ts, 2.0), "cpu") == 1
    assert count_launches(lambda: [t.mul_(2.0) for t in ts], "cpu") == 3
    # stack calls unsqueeze and cat: still one; the three sums before it are three.
    assert count_launches(lambda: torch.stack([t.sum() for t in ts]), "cpu") == 4
    assert [float(t[0]) for t in ts] == [4.0, 8.0, 12.0]  # the calls really ran, twice each


def test_nothing_launched_counts_zero() -> None:
    assert count_launches(lambda: None, "cpu") == 0


def test_host_sync_is_not_applicable_on_cpu_and_runs_nothing() -> None:
    ran = []
    assert host_sync(lambda: ran.append(1), "cpu") == "n/a"
    assert ran == []


def test_the_foreach_arm_joins_on_cuda_only() -> None:
    assert "ours_foreach" not in BenchConfig().arms()
    assert BenchConfig(device="cuda").arms()[-1] == "ours_foreach"
    assert "ours_foreach" not in BenchConfig(device="cpu", streaming=False).arms()


@pytest.mark.gpu
@needs_cuda
def test_cuda_launches_one_kernel_for_a_foreach_op_and_one_per_tensor_op() -> None:
    ts = _tensors("cuda")
    assert count_launches(lambda: torch._foreach_mul_(ts, 2.0), "cuda") == 1
    assert count_launches(lambda: [t.mul_(2.0) for t in ts], "cuda") == 3


@pytest.mark.gpu
@needs_cuda
def test_cuda_host_sync_is_caught_and_its_absence_reported() -> None:
    t = torch.ones(4, device="cuda")
    assert host_sync(lambda: t.mul_(2.0), "cuda") is None
    found = host_sync(lambda: t.sum().item(), "cuda")
    assert found is not None and "synchroniz" in found
    # The mode is off again afterwards: a sync outside raises nothing.
    assert float(t.sum()) == 8.0
