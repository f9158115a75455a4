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
    from shardscale.core import Layout, ShardedGradScaler

    rank, world = dist.get_rank(), dist.get_world_size()
    dense, experts = _expert_world(rank)
    scaler = ShardedGradScaler(
        "cpu", backend="counting+c10d", layout=Layout(distinct_params=experts), enabled=False
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


def _one_rank_bad_option_case(option: str) -> dict[str, Any]:
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
        if option == "max_norm":
            scaler.unscale_(opt, max_norm=-1.0 if rank == 1 else 1.0)
        else:  # a value of the wrong type on rank 1 only
            scaler.unscale_(opt, max_norm=1.0, fuse_optimizer="yes" if rank == 1 else None)  # type: ignore[arg-type]
        out["error"] = None
    except StepError as exc:
        out["error"], out["text"], out["ranks"] = "StepError", str(exc), exc.ranks
    except (ValueError, TypeError) as exc:
        out["error"], out["text"] = type(exc).__name__, str(exc)
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


@pytest.mark.parametrize(
    ("option", "error", "text"),
    [
        ("max_norm", "ValueError", "max_norm must be a positive number"),
        ("fuse_optimizer", "TypeError", "fuse_optimizer must be None, True or False"),
    ],
)
def test_a_bad_option_on_one_rank_stops_every_rank(
    pool2: Pool, option: str, error: str, text: str
) -> None:
    r0, r1 = pool2.run(_one_rank_bad_option_case, option, timeout=60)
    assert isinstance(r0, dict) and isinstance(r1, dict)
    assert r1["error"] == error and text in r1["text"], r1
    assert r0["error"] == "StepError" and r0["ranks"] == (1,), r0
    for r in (r0, r1):
        assert r["seconds"] < FAST, r
        assert r["grads_unchanged"] and r["scale_unchanged"], r


# -- declarations (items 4, 5, 6) ---------------------------------------------------------------


def _stage_params(rank: int) -> list[torch.nn.Parameter]:
    """Rank r's pipeline stage held in plain tensors: different values on every rank."""
    params = []
    for i, shape in enumerate(SHAPES):
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = _grad(10 * (rank + 1) + i, shape) * (rank + 1)
        params.append(p)
    return params


def _attempt(call: Any, params: list[torch.nn.Parameter], scaler: Any = None) -> dict[str, Any]:
    """Run ``call``; report what it raised, how fast, and whether anything changed."""
    from shardscale.core import StepError

    before = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    scale = scaler.get_scale() if scaler is not None else None
    out: dict[str, Any] = {"rank": dist.get_rank(), "error": None, "text": ""}
    start = time.monotonic()
    try:
        out["norm"] = float(call())
    except StepError as exc:
        out["error"], out["text"] = "StepError", str(exc)
    except Exception as exc:
        out["error"], out["text"] = type(exc).__name__, str(exc)
    out["seconds"] = time.monotonic() - start
    out["grads_unchanged"] = all(
        torch.equal(p.grad, b)  # type: ignore[arg-type]
        for p, b in zip(params, before, strict=True)
    )
    if scaler is not None:
        out["scale_unchanged"] = scaler.get_scale() == scale
        state = scaler._per_optimizer_states
        out["ready"] = all(s["stage"].name == "READY" for s in state.values())
    return out


def _pp_name_on_plain_stages_case(front: str, dims: tuple[str, ...]) -> dict[str, Any]:
    from shardscale.clip import clip_grad_norm_
    from shardscale.core import Layout, ShardedGradScaler

    rank, world = dist.get_rank(), dist.get_world_size()
    params = _stage_params(rank)
    if front == "scaler":
        opt = torch.optim.SGD(params, lr=0.1)
        scaler = ShardedGradScaler(
            "cpu", backend="c10d", layout=Layout(distinct_dims=dims), init_scale=1.0
        )
        out = _attempt(lambda: scaler.unscale_(opt, max_norm=1.0), params, scaler)
    else:
        out = _attempt(
            lambda: clip_grad_norm_(params, 1.0, backend="c10d", distinct_dims=dims), params
        )
    every = torch.cat([p.grad.flatten() for r in range(world) for p in _stage_params(r)])  # type: ignore[union-attr]
    out["want"] = float(torch.linalg.vector_norm(every.double()))
    out["numel"] = every.numel()
    return out


@pytest.mark.parametrize("front", ["scaler", "clip"])
def test_a_mesh_dim_name_on_plain_stages_is_refused_everywhere(pool2: Pool, front: str) -> None:
    # Item 4: distinct_dims=("pp",) on plain per-stage tensors counted rank 0's stage only.
    for res in pool2.run(_pp_name_on_plain_stages_case, front, ("pp",), timeout=60):
        assert isinstance(res, dict)
        assert res["error"] == "DeclarationError", res
        assert "distinct_dims=('*',)" in res["text"] and "distinct_params" in res["text"], res
        assert res["grads_unchanged"] and res["seconds"] < FAST, res
        if front == "scaler":
            assert res["scale_unchanged"] and res["ready"], res


def test_star_on_plain_stages_gives_the_true_norm(pool2: Pool) -> None:
    # The fix the refusal names: every rank's stage counts.
    for res in pool2.run(_pp_name_on_plain_stages_case, "clip", ("*",), timeout=60):
        assert isinstance(res, dict) and res["error"] is None, res
        # Two p=2 norms of the same float32 values: each within norm_rtol of the exact one.
        assert res["norm"] == pytest.approx(
            res["want"], rel=2 * norm_rtol(res["numel"], torch.float32, 2.0)
        )


def _disagreeing_case(what: str) -> dict[str, Any]:
    from shardscale.core import (
        Layout,
        LossCheck,
        ScaleBounds,
        ShardedGradScaler,
        SkipStreakLimit,
        SpikeSkip,
    )

    rank = dist.get_rank()
    dense, experts = _expert_world(rank)
    params = [*dense, *experts]
    opt = torch.optim.SGD(params, lr=0.1)
    kwargs: dict[str, Any] = {"backend": "counting+c10d", "init_scale": 1.0}
    max_norm = 1.0
    layout = Layout(distinct_params=experts)
    if what == "distinct_params":  # rank 1 forgot to declare its experts
        layout = Layout(distinct_params=experts if rank == 0 else [])
    elif what == "distinct_dims":  # rank 0 says every plain tensor is its own, rank 1 not
        layout = Layout(
            distinct_dims=("*",) if rank == 0 else (), distinct_params=experts if rank == 1 else []
        )
    elif what == "max_norm":
        max_norm = 1.0 + rank
    elif what == "spike":  # one threshold per rank: one rank would skip while the other steps
        kwargs["policies"] = [SpikeSkip(z=6.0 if rank == 0 else 3.0)]
    elif what == "streak":  # one rank would stop while the other went on
        kwargs["policies"] = [SkipStreakLimit(max_skips=10 + rank)]
    elif what == "scale_bounds":  # the ranks' scales would drift apart
        kwargs["loss_scaling"] = ScaleBounds(hysteresis=1 + rank)
    elif what == "same_spelled_differently":  # equal options, written two ways: they agree
        # In another order; LossCheck on rank 0 only: it is not declared, each rank adding its
        # own loss flag to the reduced vector (0 without a loss, as a pipeline's first stages).
        kwargs["policies"] = (
            [SpikeSkip(z=6), LossCheck(), SkipStreakLimit(max_skips=3)]
            if rank == 0
            else [SkipStreakLimit(max_skips=3), SpikeSkip(z=6.0)]
        )
        kwargs["loss_scaling"] = ScaleBounds(min_scale=1 if rank == 0 else 1.0)
    scaler = ShardedGradScaler("cpu", layout=layout, **kwargs)
    out = _attempt(lambda: scaler.unscale_(opt, max_norm=max_norm), params, scaler)
    out["collectives"] = len(scaler.backend.records)  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize(
    "what", ["distinct_params", "distinct_dims", "max_norm", "spike", "streak", "scale_bounds"]
)
def test_ranks_that_declare_differently_all_raise(pool2: Pool, what: str) -> None:
    # Item 5: a wrong norm, identical on every rank and without a word, before.
    for res in pool2.run(_disagreeing_case, what, timeout=60):
        assert isinstance(res, dict)
        assert res["error"] == "DeclarationError", res
        assert "ranks [0] vs ranks [1]" in res["text"], res
        assert res["grads_unchanged"] and res["scale_unchanged"] and res["ready"], res
        assert res["seconds"] < FAST, res
        # The fingerprint rode in the step's one all-reduce (the chain check is beside it).
        assert res["collectives"] == 1, res


def test_ranks_with_the_same_options_written_differently_agree(pool2: Pool) -> None:
    # SpikeSkip(z=6) and SpikeSkip(z=6.0), policies in another order, min_scale=1 and 1.0.
    for res in pool2.run(_disagreeing_case, "same_spelled_differently", timeout=60):
        assert isinstance(res, dict)
        assert res["error"] is None, res
        assert res["collectives"] == 1, res


def _stranger_case(front: str) -> dict[str, Any]:
    from shardscale.clip import clip_grad_norm_
    from shardscale.core import Layout, ShardedGradScaler

    rank = dist.get_rank()
    dense, experts = _expert_world(rank)
    # Declared, then replaced (as fully_shard or a copy of the model would): a stranger.
    declared = [torch.nn.Parameter(e.detach().clone()) for e in experts]
    params = [*dense, *experts]
    if front == "scaler":
        opt = torch.optim.SGD(params, lr=0.1)
        scaler = ShardedGradScaler("cpu", backend="c10d", layout=Layout(distinct_params=declared))
        return _attempt(lambda: scaler.unscale_(opt, max_norm=1.0), params, scaler)
    return _attempt(
        lambda: clip_grad_norm_(params, 1.0, backend="c10d", distinct_params=declared), params
    )


@pytest.mark.parametrize("front", ["scaler", "clip"])
def test_distinct_params_outside_the_step_are_refused(pool2: Pool, front: str) -> None:
    # Item 6: they were matched by id() and silently ignored.
    for res in pool2.run(_stranger_case, front, timeout=60):
        assert isinstance(res, dict)
        assert res["error"] == "DeclarationError", res
        assert "not" in res["text"] and "would be ignored" in res["text"], res
        assert res["grads_unchanged"] and res["seconds"] < FAST, res
        if front == "scaler":
            assert res["scale_unchanged"] and res["ready"], res
