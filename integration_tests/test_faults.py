"""Ranks that die or raise mid-step, and layouts the scaler's group cannot combine.

A fault is injected on the last rank *inside* the scaler's found_inf all-reduce
of the second step, by wrapping its collective backend (the real ``c10d``
backend; the other ranks use it unwrapped):

* ``before``: the faulty rank never issues the collective;
* ``during``: it issues it, then fails while the collective is in flight;
* ``after``: the collective completes, then it fails in ``wait()``.

It fails by raising (the process lives on, as a rank stuck in user code would)
or by dying (``os._exit``). The scaler reduces over a process group with a
short, configured timeout. The surviving ranks must raise — never hang — an
error that names the collective and that timeout, carrying a note that it
was the scaler's overflow check. Every case is bounded by the harness's
per-case timeout, so a hang fails the test instead of blocking CI.

Deaths tear the pool down (the harness restarts it), so they run last.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool, RankFailure

from shardscale.core import Handle, LayoutError, ReduceOp, ShardedGradScaler

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

#: The process-group timeout the scaler's collectives run under, in seconds.
PG_TIMEOUT = 2.0
#: The harness bound per case: a survivor that hangs fails the test well before this.
CASE_TIMEOUT = 40.0
#: The fault fires in this (1-based) found_inf collective: step 0 completes everywhere first.
FAULT_CALL = 2
STEPS = 4
EXIT_CODE = 17


class InjectedFault(RuntimeError):
    """What the faulty rank raises (it is caught there: that rank stays alive)."""


class _AfterHandle:
    def __init__(self, inner: Handle, fire: Callable[[], None]) -> None:
        self.inner, self.fire = inner, fire

    def wait(self) -> None:
        self.inner.wait()
        self.fire()


class FaultyBackend:
    """Wraps a real backend and fails at one collective, at one phase of it."""

    name: ClassVar[str] = "faulty"

    def __init__(self, inner: Any, *, kind: str, phase: str, armed: bool) -> None:
        self.inner, self.kind, self.phase, self.armed = inner, kind, phase, armed
        self.calls = 0

    def _fire(self) -> None:
        if self.kind == "die":
            os._exit(EXIT_CODE)
        raise InjectedFault(f"injected fault {self.phase} the found_inf collective")

    def all_reduce(self, tensor: torch.Tensor, *, op: ReduceOp, group: Any) -> Handle:
        self.calls += 1
        hit = self.armed and self.calls == FAULT_CALL
        if hit and self.phase == "before":
            self._fire()
        handle = self.inner.all_reduce(tensor, op=op, group=group)
        if hit and self.phase == "during":
            self._fire()
        if hit and self.phase == "after":
            return _AfterHandle(handle, self._fire)
        return handle

    def world_size(self, group: Any) -> int:
        return int(self.inner.world_size(group))

    def rank(self, group: Any) -> int:
        return int(self.inner.rank(group))

    def group_ranks(self, group: Any) -> tuple[int, ...]:
        return tuple(self.inner.group_ranks(group))


# -- cases (run on every rank) ------------------------------------------------------------------


def _case_fault(kind: str, phase: str) -> dict[str, Any]:
    from shardscale.collectives import C10dBackend

    rank, world = dist.get_rank(), dist.get_world_size()
    faulty = rank == world - 1
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    # Every rank runs the same chain (shardscale checks that); only the last rank's fires.
    backend = FaultyBackend(C10dBackend(), kind=kind, phase=phase, armed=faulty)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", process_group=group, backend=backend)
    steps_done = 0
    outcome: dict[str, Any] = {"rank": rank, "faulty": faulty}
    try:
        for step in range(STEPS):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            scaler.scale(model(x).square().sum()).backward()
            scaler.step(opt)
            scaler.update()
            steps_done += 1
        outcome["error"] = None
    except InjectedFault as exc:
        outcome["error"] = f"injected: {exc}"
    except Exception as exc:
        if kind == "die":
            raise  # the harness reports it with this rank's traceback
        outcome["error"] = str(exc)
        outcome["type"] = [c.__name__ for c in type(exc).__mro__]
        outcome["notes"] = list(getattr(exc, "__notes__", []))
    outcome["steps_done"] = steps_done
    # Everyone is past the fault now: retire the group the fault left inconsistent.
    dist.barrier()
    dist.destroy_process_group(group)
    return outcome


def _case_layout_mismatch() -> dict[str, Any]:
    """One optimizer, parameters on a mesh of every rank and on a one-rank mesh, and a scaler
    whose group holds only this rank: no adapter can combine that, and nothing may change."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]
    wide = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fully_shard(model[0], mesh=wide)
    fully_shard(model, mesh=wide)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", process_group=singles[rank], backend="c10d")
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    scaler.scale(model(x).sum()).backward()
    grads = [p.grad.to_local().clone() for p in model.parameters()]  # type: ignore[union-attr]
    params = [p.detach().to_local().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    scale = scaler.get_scale()
    try:
        scaler.step(opt)
    except LayoutError as exc:
        message = str(exc)
    else:
        message = None
    unchanged = (
        all(
            torch.equal(g, p.grad.to_local())  # type: ignore[union-attr]
            for g, p in zip(grads, model.parameters(), strict=True)
        )
        and all(
            torch.equal(a, p.detach().to_local())  # type: ignore[attr-defined]
            for a, p in zip(params, model.parameters(), strict=True)
        )
        and scaler.get_scale() == scale
        and not opt.state
    )
    for g in singles:
        dist.destroy_process_group(g)
    return {"message": message, "unchanged": unchanged}


# -- tests --------------------------------------------------------------------------------------


def _assert_clear(message: str) -> None:
    assert "all_reduce" in message, message
    assert re.search(rf"timeout {PG_TIMEOUT:g}(\.0)?\s?s", message), message


@pytest.mark.parametrize("phase", ["before", "during", "after"])
def test_a_rank_that_raises_mid_step(pool2: Pool, phase: str) -> None:
    results = pool2.run(_case_fault, "raise", phase, timeout=CASE_TIMEOUT)
    survivors = [r for r in results if isinstance(r, dict) and not r["faulty"]]
    faulty = [r for r in results if isinstance(r, dict) and r["faulty"]]
    assert len(survivors) == pool2.world_size - 1 and len(faulty) == 1
    assert faulty[0]["error"].startswith("injected")
    for res in survivors:
        assert res["error"], f"rank {res['rank']} finished training with a dead peer"
        _assert_clear(res["error"])
        assert "CollectiveError" in res["type"] and "RuntimeError" in res["type"]
        assert any("all-reduce" in note and "every rank" in note for note in res["notes"]), res[
            "notes"
        ]
        # Before: the second step's collective never completes. During/after: the faulty
        # rank's contribution made it, so the survivors fail one collective later.
        assert res["steps_done"] == (FAULT_CALL - 1 if phase == "before" else FAULT_CALL)


def test_params_the_scaler_group_cannot_combine(pool2: Pool) -> None:
    pytest.importorskip("shardscale.fsdp")
    for res in pool2.run(_case_layout_mismatch, timeout=CASE_TIMEOUT):
        assert isinstance(res, dict)
        assert res["message"] is not None, "the scaler accepted a group missing a shard's ranks"
        assert "process_group=" in res["message"] and "missing" in res["message"]
        assert res["unchanged"]


@pytest.mark.parametrize("phase", ["before", "during", "after"])
def test_a_rank_that_dies_mid_step(pool2: Pool, phase: str) -> None:
    with pytest.raises(RankFailure) as info:
        pool2.run(_case_fault, "die", phase, timeout=CASE_TIMEOUT)
    report = str(info.value)
    faulty_rank = pool2.world_size - 1
    # The harness may see the pipe close before the exit code is known.
    assert re.search(rf"rank {faulty_rank} died \(exit code ({EXIT_CODE}|None)\)", report), report
    # Every survivor answered (with its own clear error) instead of hanging.
    assert "did not answer" not in report, report
    for rank in range(faulty_rank):
        section = report.split(f"--- rank {rank} failed ---", 1)
        assert len(section) == 2, f"rank {rank} did not report an error:\n{report}"
        _assert_clear(section[1].split("--- rank", 1)[0])
