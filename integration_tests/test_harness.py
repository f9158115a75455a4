"""Self-test of the multi-process harness: results, failures, timeouts, recovery."""

from __future__ import annotations

import os
import time

import pytest
from mp_harness import CaseTimeout, Pool, RankFailure

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _rank_info(offset: int, *, scale: int = 1) -> tuple[int, int, str, int]:
    import torch
    import torch.distributed as dist

    return (
        dist.get_rank() * scale + offset,
        dist.get_world_size(),
        os.environ["OMP_NUM_THREADS"],
        torch.get_num_threads(),
    )


def _all_reduce_rank() -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return float(t.item())


def _raise_on_rank_one() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    return dist.get_rank()


def _sleep(seconds: float) -> int:
    time.sleep(seconds)
    return 0


def _set_env() -> str | None:
    previous = os.environ.get("SHARDSCALE_HARNESS_PROBE")
    os.environ["SHARDSCALE_HARNESS_PROBE"] = "set"
    return previous


def _pid() -> int:
    return os.getpid()


def test_returns_rank_ordered_results(pool2: Pool) -> None:
    results = pool2.run(_rank_info, 10, scale=3)
    assert results == [(10, 2, "1", 1), (13, 2, "1", 1)]


def test_collective_inside_a_case(pool2: Pool) -> None:
    # 1 + 2 over two ranks
    assert pool2.run(_all_reduce_rank) == [3.0, 3.0]


def test_environment_does_not_leak_between_cases(pool2: Pool) -> None:
    assert pool2.run(_set_env) == [None, None]
    assert pool2.run(_set_env) == [None, None]


def test_rank_failure_carries_traceback_and_pool_recovers(pool2: Pool) -> None:
    pids_before = pool2.run(_pid)
    with pytest.raises(RankFailure) as info:
        pool2.run(_raise_on_rank_one)
    message = str(info.value)
    assert "rank(s) [1]" in message
    assert "ValueError: boom on rank one" in message
    assert "_raise_on_rank_one" in message
    # A fresh generation of workers answers the next case.
    pids_after = pool2.run(_pid)
    assert set(pids_after).isdisjoint(pids_before)
    assert pool2.run(_all_reduce_rank) == [3.0, 3.0]


def test_timeout_is_bounded_and_pool_recovers(pool2: Pool) -> None:
    pool2.run(_pid)  # make sure the workers are up so the bound measures the case only
    start = time.monotonic()
    with pytest.raises(CaseTimeout) as info:
        pool2.run(_sleep, 60.0, timeout=1.0)
    elapsed = time.monotonic() - start
    # The deadline plus the stack dump and the kill, far below the 60 s sleep.
    assert elapsed < 20.0
    assert "did not finish within 1s" in str(info.value)
    assert "_sleep" in str(info.value)  # the stack dump names where the rank was stuck
    assert pool2.run(_rank_info, 0) == [(0, 2, "1", 1), (1, 2, "1", 1)]


def test_local_functions_are_refused_clearly(pool2: Pool) -> None:
    def inner() -> int:
        return 1

    with pytest.raises(TypeError, match="top level"):
        pool2.run(inner)
    with pytest.raises(TypeError, match="top level"):
        pool2.run(lambda: 1)


def test_closed_pool_refuses_work() -> None:
    pool = Pool(1)
    try:
        assert pool.run(_rank_info, 5) == [(5, 1, "1", 1)]
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(_pid)


def _exit_hard() -> int:
    os._exit(7)


def test_a_dead_worker_is_reported_and_replaced(pool2: Pool) -> None:
    with pytest.raises(RankFailure, match=r"died \(exit code 7\)"):
        pool2.run(_exit_hard)
    assert pool2.run(_all_reduce_rank) == [3.0, 3.0]
