"""Checkpoints cross between torch's scalers and ours, and load with ``weights_only=True``.

Each interop test trains with one scaler class for a few steps (with overflow
steps, and stopping when the growth tracker is mid-interval so that losing it
would change when the scale next grows), writes model, optimizer and scaler
state with ``torch.save``, reads it back with ``torch.load(weights_only=True)``
into a fresh model, optimizer and a scaler of the *other* class, and continues.
The resumed run must match the uninterrupted run of the original class step by
step: the same scale after every ``update()`` and bit-identical parameters.

FSDP1's ``ShardedGradScaler`` reduces its overflow flag with
``torch.distributed``, so those cases run inside a one-rank gloo process group
that the fixture creates and destroys.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as Fsdp1Scaler

from shardscale.core import ScaleBounds, ShardedGradScaler

GROWTH_INTERVAL = 3
INIT_SCALE = 2.0**12
OVERFLOW_STEPS = frozenset({2, 4, 9, 10})
SPLIT = 7  # checkpoint after this many steps
TOTAL = 15


def _ours() -> Any:
    return ShardedGradScaler(
        "cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, backend="local"
    )


def _torch() -> Any:
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)


def _fsdp1() -> Any:
    return Fsdp1Scaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)


SCALERS: dict[str, Callable[[], Any]] = {"ours": _ours, "torch": _torch, "fsdp1": _fsdp1}


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(
    scaler: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range
) -> list[tuple[float, list[torch.Tensor]]]:
    """Train over ``steps``; after each, the scale and a copy of the parameters."""
    trace = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(6, 8, generator=gen)
        if step in OVERFLOW_STEPS:
            x[step % 6, step % 8] = math.inf
        opt.zero_grad()
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        trace.append((scaler.get_scale(), [p.detach().clone() for p in model.parameters()]))
    return trace


def _assert_same_trace(
    expected: list[tuple[float, list[torch.Tensor]]], got: list[tuple[float, list[torch.Tensor]]]
) -> None:
    assert len(expected) == len(got)
    for step, ((s1, p1), (s2, p2)) in enumerate(zip(expected, got, strict=True)):
        assert s1 == s2, f"scale differs after resumed step {step}: {s1} vs {s2}"
        for a, b in zip(p1, p2, strict=True):
            assert torch.equal(a, b), f"parameters differ after resumed step {step}"


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A world-size-1 gloo default group (FSDP1's scaler all-reduces found_inf)."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a multi-rank default process group is already initialized here")
        yield
        return
    store = dist.FileStore(str(tmp_path / "store"), 1)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _needs_group(*names: str) -> bool:
    return "fsdp1" in names


@pytest.mark.parametrize(
    ("source", "target"),
    [("torch", "ours"), ("ours", "torch"), ("fsdp1", "ours"), ("ours", "fsdp1"), ("ours", "ours")],
)
def test_checkpoint_crosses_classes_and_resumes_identically(
    source: str, target: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if _needs_group(source, target):
        request.getfixturevalue("one_rank_group")
    # The uninterrupted run of the source class.
    scaler, model, opt = SCALERS[source](), *_model()
    head = _train(scaler, model, opt, range(SPLIT))
    path = tmp_path / "ckpt.pt"
    torch.save(
        {"model": model.state_dict(), "optim": opt.state_dict(), "scaler": scaler.state_dict()},
        path,
    )
    tail = _train(scaler, model, opt, range(SPLIT, TOTAL))

    ckpt = torch.load(path, weights_only=True)
    # The checkpoint is taken mid growth interval, so losing the tracker would show.
    assert 0 < ckpt["scaler"]["_growth_tracker"] < GROWTH_INTERVAL
    assert ckpt["scaler"]["scale"] != INIT_SCALE
    resumed_scaler, resumed_model, resumed_opt = SCALERS[target](), *_model()
    resumed_model.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["optim"])
    resumed_scaler.load_state_dict(ckpt["scaler"])
    assert resumed_scaler.get_scale() == head[-1][0]
    resumed = _train(resumed_scaler, resumed_model, resumed_opt, range(SPLIT, TOTAL))
    _assert_same_trace(tail, resumed)
    # The scale really moved both ways after the checkpoint (growth and back-off).
    scales = [s for s, _ in tail]
    assert max(scales) > head[-1][0] and min(scales) < head[-1][0]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"loss_scaling": ScaleBounds(hysteresis=3, min_scale=1.0, max_scale=2.0**20)},
        {"enabled": False},
    ],
    ids=["default", "hysteresis-and-bounds", "disabled"],
)
def test_state_dict_holds_only_plain_numbers(options: dict[str, Any], tmp_path: Path) -> None:
    scaler = ShardedGradScaler(
        "cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, backend="local", **options
    )
    model, opt = _model()
    _train(scaler, model, opt, range(SPLIT))
    state = scaler.state_dict()
    assert all(type(v) in (int, float) for v in state.values()), state
    path = tmp_path / "scaler.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded == state
    if not options.get("enabled", True):
        assert state == {}
        return
    if "loss_scaling" in options:
        assert {"hysteresis", "_hysteresis_tracker", "min_scale", "max_scale"} <= state.keys()
    fresh = ShardedGradScaler("cpu", backend="local", **options)
    fresh.load_state_dict(loaded)
    assert fresh.state_dict() == state
    # And it continues exactly as the original.
    model2, opt2 = _model()
    model2.load_state_dict(model.state_dict())
    # A deep copy: load_state_dict would otherwise share Adam's moment tensors.
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    _assert_same_trace(
        _train(scaler, model, opt, range(SPLIT, TOTAL)),
        _train(fresh, model2, opt2, range(SPLIT, TOTAL)),
    )


def test_our_extra_keys_load_into_torch() -> None:
    """Hysteresis and bounds add keys; torch's scaler ignores them and takes the rest."""
    ours = ShardedGradScaler(
        "cpu", backend="local", loss_scaling=ScaleBounds(hysteresis=2, max_scale=2.0**30)
    )
    model, opt = _model()
    _train(ours, model, opt, range(SPLIT))
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    for key, value in theirs.state_dict().items():
        assert ours.state_dict()[key] == value


def test_scaler_is_a_dcp_stateful() -> None:
    scaler = _ours()
    assert isinstance(scaler, Stateful)
    # DCP fills the dict that state_dict() returns and hands it back to load_state_dict().
    template = scaler.state_dict()
    template["scale"], template["_growth_tracker"] = 8.0, 2
    scaler.load_state_dict(template)
    assert scaler.get_scale() == 8.0 and scaler._get_growth_tracker() == 2
