"""Trainings in threads of one process: each sees only its own numbers ([Note: whose scratch]).

Two cases the step's state must survive: two independent trainings in two threads (no
process group, each with its own scaler), and four ranks run as threads of one process
(torch's threaded process group, the one torch's own DTensor tests use). Every step's
norm is compared with the true norm computed in the same thread from the same gradients,
and every skip with the injected infs.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from shardscale.clip import get_total_norm, unscale_and_clip_
from shardscale.core import ShardedGradScaler

STEPS = 150
SCALE = 2.0**10
SHAPES = [(64, 33), (33,), (17, 9), (128,)]


def _grads(owner: int, step: int) -> list[torch.Tensor]:
    """The unscaled gradients of ``owner`` at ``step``: deterministic, different per owner."""
    gen = torch.Generator().manual_seed(1000 * owner + step)
    return [torch.randn(shape, generator=gen) * (1 + owner) for shape in SHAPES]


def _true_norm(grads: list[torch.Tensor]) -> float:
    # float64 reference of the float32 engine's norm.
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads))


def _run_threads(target: Callable[[int], None], count: int) -> None:
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]


def _inf_at(owner: int, step: int) -> bool:
    return owner == 1 and step % 7 == 3


@pytest.mark.timeout(300)
def test_two_trainings_in_two_threads_see_their_own_norms_and_skips() -> None:
    wrong: dict[int, list[tuple[int, float, float]]] = {0: [], 1: []}
    skipped: dict[int, list[int]] = {0: [], 1: []}
    barrier = threading.Barrier(2)

    def train(owner: int) -> None:
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
        opt = torch.optim.SGD(params, lr=0.0)
        scaler = ShardedGradScaler("cpu", init_scale=SCALE, growth_interval=10**6)
        for step in range(STEPS):
            grads = _grads(owner, step)
            scale = float(scaler.get_scale())
            for p, g in zip(params, grads, strict=True):
                p.grad = g * scale
            if _inf_at(owner, step):
                params[0].grad[0, 0] = math.inf
            barrier.wait()  # both threads step at the same time: the races a shared scratch had
            norm = unscale_and_clip_(scaler, opt, max_norm=math.inf)
            scaler.step(opt)
            scaler.update()
            if float(scaler.get_scale()) < scale:
                skipped[owner].append(step)
            elif not math.isclose(float(norm), _true_norm(grads), rel_tol=1e-5):
                # float32 accumulation of ~2.3k squares: relative error far below 1e-5.
                wrong[owner].append((step, float(norm), _true_norm(grads)))
            scaler.update(SCALE)  # back to the same scale, so every step is comparable

    _run_threads(train, 2)
    assert wrong == {0: [], 1: []}
    assert skipped[0] == []  # the clean training never skips for the other's inf
    assert skipped[1] == [s for s in range(STEPS) if _inf_at(1, s)]


@pytest.mark.timeout(300)
def test_get_total_norm_in_two_threads() -> None:
    wrong: list[tuple[int, int]] = []
    barrier = threading.Barrier(2)

    def measure(owner: int) -> None:
        for step in range(STEPS):
            grads = _grads(owner, step)
            barrier.wait()
            norm = get_total_norm(grads, 2.0)
            if not math.isclose(float(norm), _true_norm(grads), rel_tol=1e-5):
                wrong.append((owner, step))

    _run_threads(measure, 2)
    assert wrong == []


@pytest.mark.timeout(300)
def test_four_ranks_as_threads_of_one_process() -> None:
    from torch.testing._internal.distributed import multi_threaded_pg

    world = 4
    store = dist.HashStore()
    wrong: list[tuple[int, int, str]] = []
    skipped: dict[int, list[int]] = {r: [] for r in range(world)}
    # As torch's own threaded tests: process groups registered per thread, not per process.
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    multi_threaded_pg._install_threaded_pg()
    try:

        def rank_main(rank: int) -> None:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            try:
                params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
                opt = torch.optim.SGD(params, lr=0.0)
                scaler = ShardedGradScaler("cpu", init_scale=SCALE, growth_interval=10**6)
                for step in range(STEPS // 3):
                    grads = _grads(rank, step)
                    for p, g in zip(params, grads, strict=True):
                        p.grad = g * SCALE
                    inf = rank == 2 and step % 5 == 1
                    if inf:
                        params[1].grad[0] = math.inf
                    # Plain tensors are replicas by default: rank 0's copy is the one counted.
                    norm = unscale_and_clip_(scaler, opt, max_norm=math.inf)
                    scaler.step(opt)
                    scaler.update()
                    if float(scaler.get_scale()) < SCALE:
                        skipped[rank].append(step)
                    elif not math.isclose(float(norm), _true_norm(_grads(0, step)), rel_tol=1e-5):
                        wrong.append((rank, step, "scaler"))
                    scaler.update(SCALE)
                    # Every rank holds its own tensors: the norm over all four.
                    every = [g for r in range(world) for g in _grads(r, step)]
                    total = get_total_norm(_grads(rank, step), 2.0, distinct_dims=("*",))
                    if not math.isclose(float(total), _true_norm(every), rel_tol=1e-5):
                        wrong.append((rank, step, "get_total_norm"))
            except BaseException as exc:
                multi_threaded_pg.ProcessLocalGroup.exception_handle(exc)  # wake the peers
                raise
            finally:
                dist.destroy_process_group()

        _run_threads(rank_main, world)
    finally:
        multi_threaded_pg.ProcessLocalGroup.reset()
        multi_threaded_pg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    assert wrong == []
    expected = [s for s in range(STEPS // 3) if s % 5 == 1]
    assert skipped == {r: expected for r in range(world)}
