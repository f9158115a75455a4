"""The step contract across real gloo ranks (issue 18: one contract, declarations agreed).

* ``ShardedGradScaler.clip_grad_norm_`` clips by the true global norm with the
  scaler's whole configuration (``distinct_params`` included), in one collective.
* A bad option on one rank only stops every rank within seconds, nothing changed.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool
from tolerances import clipped_grad_rtol, norm_rtol

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

#: An error carried in the step's all-reduce arrives well within this (the harness's
#: process-group timeout, what a peer left waiting would hit, is 60 s).
FAST = 15.0
SHAPES = [(6, 5), (5,)]


def _grad(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).float()


def _expert_world(rank: int) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Replicated dense parameters (same gradient everywhere) and this rank's own experts."""
    dense = []
    for i, shape in enumerate(SHAPES):
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = _grad(100 + i, shape)
        dense.append(p)
    experts = []
    for i, shape in enumerate(SHAPES):
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = _grad(1000 * (rank + 1) + i, shape) * (rank + 2)
        experts.append(p)
    return dense, experts


def _clip_with_distinct_params_case(max_norm: float) -> dict[str, Any]:
    from shardscale.core import ShardedGradScaler

    rank, world = dist.get_rank(), dist.get_world_size()
    dense, experts = _expert_world(rank)
    scaler = ShardedGradScaler(
        "cpu", backend="counting+c10d", distinct_params=experts, enabled=False
    )
    norm = scaler.clip_grad_norm_([*dense, *experts], max_norm)
    # What one process holding every rank's experts computes with torch.
    everything = [p.grad for p in _expert_world(0)[0]]
    for r in range(world):
        everything += [p.grad for p in _expert_world(r)[1]]
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in everything]
    for p, g in zip(ref, everything, strict=True):
        p.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    mine = ref[: len(SHAPES)] + ref[len(SHAPES) * (rank + 1) : len(SHAPES) * (rank + 2)]
    backend: Any = scaler.backend
    return {
        "norm": float(norm),
        "want": float(want),
        "numel": sum(g.numel() for g in everything),
        "grads": [p.grad.clone() for p in [*dense, *experts]],  # type: ignore[union-attr]
        "want_grads": [p.grad.clone() for p in mine],  # type: ignore[union-attr]
        "collectives": len(backend.records),
    }


@pytest.mark.parametrize("max_norm", [0.5, math.inf])
def test_scaler_clip_grad_norm_is_the_true_norm_with_distinct_params(
    pool2: Pool, max_norm: float
) -> None:
    for res in pool2.run(_clip_with_distinct_params_case, max_norm, timeout=60):
        assert isinstance(res, dict)
        n = res["numel"]
        # Two p=2 norms of the same n float32 values: each within norm_rtol of the exact one.
        assert res["norm"] == pytest.approx(res["want"], rel=2 * norm_rtol(n, torch.float32, 2.0))
        rtol = 2 * clipped_grad_rtol(n, torch.float32, 2.0)
        for got, want in zip(res["grads"], res["want_grads"], strict=True):
            torch.testing.assert_close(got, want, rtol=rtol, atol=0.0)
        assert res["collectives"] == 1, res


def _one_rank_bad_max_norm_case() -> dict[str, Any]:
    from shardscale.core import ShardedGradScaler, StepError

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", backend="c10d", init_scale=8.0)
    scaler.scale(model(torch.ones(2, 4)).square().mean()).backward()
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    scale_before = scaler.get_scale()
    start = time.monotonic()
    out: dict[str, Any] = {"rank": rank}
    try:
        scaler.unscale_(opt, max_norm=-1.0 if rank == 1 else 1.0)
        out["error"] = None
    except StepError as exc:
        out["error"], out["text"], out["ranks"] = "StepError", str(exc), exc.ranks
    except ValueError as exc:
        out["error"], out["text"] = "ValueError", str(exc)
    out["seconds"] = time.monotonic() - start
    out["grads_unchanged"] = all(
        torch.equal(p.grad, b)  # type: ignore[arg-type]
        for p, b in zip(model.parameters(), before, strict=True)
    )
    out["scale_unchanged"] = scaler.get_scale() == scale_before
    # Still READY: the legal call unscales once and steps (every rank, in step).
    scaler.unscale_(opt, max_norm=1.0)
    scaler.step(opt)
    scaler.update()
    return out


def test_a_bad_max_norm_on_one_rank_stops_every_rank(pool2: Pool) -> None:
    r0, r1 = pool2.run(_one_rank_bad_max_norm_case, timeout=60)
    assert isinstance(r0, dict) and isinstance(r1, dict)
    assert r1["error"] == "ValueError" and "max_norm must be a positive number" in r1["text"]
    assert r0["error"] == "StepError" and r0["ranks"] == (1,), r0
    for r in (r0, r1):
        assert r["seconds"] < FAST, r
        assert r["grads_unchanged"] and r["scale_unchanged"], r
