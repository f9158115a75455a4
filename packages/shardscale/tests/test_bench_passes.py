"""Gradient-sized passes of a whole post-processing step (optimizer included), counted.

One process, plain tensors: G is the bytes of the gradients, and parameters
and Adam's moments are the same size, so every count below is a number of
passes worked out by hand from the recipe; the floor table of ``_passes``
is then held against what was counted.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from shardscale.cli.bench import GradBytesCounter
from shardscale.cli.bench._passes import KERNEL_WRITE_BACK, floor_passes, floor_ratio

SIZES = ((10, 4), (6,))
G = (10 * 4 + 6) * 4


def _model(opt_name: str) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s)) for s in SIZES]
    opts: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "sgd": lambda: torch.optim.SGD(params, lr=0.1, foreach=True),
        "sgd_fused": lambda: torch.optim.SGD(params, lr=0.1, fused=True),
        "adam_fused": lambda: torch.optim.Adam(params, lr=1e-2, fused=True),
        "adamw_fused": lambda: torch.optim.AdamW(params, lr=1e-2, fused=True),
    }
    return params, opts[opt_name]()


def _backward(params: list[torch.nn.Parameter], scaler: object) -> None:
    loss = sum((p * p).sum() * (i + 2) for i, p in enumerate(params))
    scaler.scale(loss).backward()  # type: ignore[attr-defined]


def _torch_post(
    params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, scaler: object
) -> None:
    scaler.unscale_(opt)  # type: ignore[attr-defined]
    torch.nn.utils.clip_grad_norm_(params, 1e-6)
    scaler.step(opt)  # type: ignore[attr-defined]
    scaler.update()  # type: ignore[attr-defined]


def _ours_post(
    params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, scaler: object
) -> None:
    from shardscale.clip import unscale_and_clip_

    unscale_and_clip_(scaler, opt, 1e-6)  # type: ignore[arg-type]
    scaler.step(opt)  # type: ignore[attr-defined]
    scaler.update()  # type: ignore[attr-defined]


def _count(recipe: str, opt_name: str) -> GradBytesCounter:
    # recipe: "torch", "ours" (the defaults) or "ours_fuse_optimizer" (fuse_optimizer=True).
    params, opt = _model(opt_name)
    if recipe == "torch":
        scaler: object = torch.amp.GradScaler("cpu", init_scale=1024.0)
        post: Callable[..., None] = _torch_post
    else:
        from shardscale.core import ShardedGradScaler

        fold = recipe == "ours_fuse_optimizer"
        scaler = ShardedGradScaler("cpu", init_scale=1024.0, fuse_optimizer=fold)
        post = _ours_post
    for _ in range(2):  # the second step is counted: Adam's moments exist by then
        opt.zero_grad(set_to_none=True)
        _backward(params, scaler)
        counter = GradBytesCounter([p.grad for p in params if p.grad is not None])
        state = [*params, *(v for s in opt.state.values() for v in s.values() if v.numel() > 1)]
        counter.add_state(state)
        with counter:
            post(params, opt, scaler)
    return counter


def _passes(c: GradBytesCounter) -> float:
    return (c.read + c.written + c.state_read + c.state_written) / G


# Hand counts, in G: (grad read, grad written, state read, state written).
HAND = {
    # unscale R+W, norm R, clip R+W; SGD reads the grad and reads+writes the parameter.
    ("torch", "sgd"): (4, 2, 1, 1),
    # the same three passes; fused Adam (no grad_scale after unscale_) reads the grad and
    # reads+writes the parameter and both moments.
    ("torch", "adam_fused"): (4, 2, 3, 3),
    # statistics R, the multiply R+W (the default steps the foreach SGD as built); SGD reads
    # the grad and reads+writes the parameter.
    ("ours", "sgd"): (3, 1, 1, 1),
    # statistics R; with fuse_optimizer=True the foreach SGD's step runs through torch's fused
    # kernel with grad_scale: it reads the grad and writes it back unscaled, reads+writes the
    # parameter.
    ("ours_fuse_optimizer", "sgd"): (2, 1, 1, 1),
    ("ours_fuse_optimizer", "adam_fused"): (2, 1, 3, 3),
    # statistics R; fused Adam with grad_scale reads the grad and writes it back unscaled.
    ("ours", "adam_fused"): (2, 1, 3, 3),
    # Every fused optimizer is the apply: no multiply pass, the kernel's write-back instead.
    ("ours", "adamw_fused"): (2, 1, 3, 3),
    ("ours", "sgd_fused"): (2, 1, 1, 1),
}


@pytest.mark.parametrize(("recipe", "opt_name"), list(HAND), ids=[f"{r}-{o}" for r, o in HAND])
def test_passes_match_the_hand_count(recipe: str, opt_name: str) -> None:
    c = _count(recipe, opt_name)
    got = (c.read / G, c.written / G, c.state_read / G, c.state_written / G)
    assert got == HAND[(recipe, opt_name)]


def test_floors_against_what_the_recipes_counted() -> None:
    # torch's floor is what torch's recipe does.
    for opt_name in ("sgd", "adam_fused"):
        assert floor_passes("torch", opt_name) == _passes(_count("torch", opt_name))
    # By default the foreach SGD steps as built: the multiply, at its floor (6 against 8).
    assert _passes(_count("ours", "sgd")) == floor_passes("ours", "sgd") == 6
    # Ours is one write above the floor wherever torch's kernel takes grad_scale (fused Adam;
    # SGD with fuse_optimizer=True): it writes the unscaled gradient back (see [Note: the
    # pass-count floor]).
    fold = "ours_fuse_optimizer"
    assert _passes(_count(fold, "sgd")) == floor_passes(fold, "sgd") + KERNEL_WRITE_BACK == 5
    assert _passes(_count("ours", "adam_fused")) == floor_passes("ours", "adam_fused") + 1 == 9
    assert _passes(_count(fold, "adam_fused")) == floor_passes(fold, "adam_fused") + 1 == 9
    assert floor_passes("ours_streaming", "sgd") == 5  # the default multiplies
    assert floor_passes("ours_streaming", "adam_fused") == 7
    assert floor_ratio("ours", "sgd") == pytest.approx(6 / 8)
    assert floor_ratio(fold, "sgd") == pytest.approx(4 / 8)
    assert floor_ratio("ours", "adam_fused") == pytest.approx(8 / 12)
    assert floor_passes("ours", "lion") is None and floor_passes("other", "sgd") is None


def test_state_writes_count_by_schema_even_when_bits_do_not_change() -> None:
    # An update far below the parameter's ulp leaves its bits alone but still costs the write.
    p = torch.nn.Parameter(torch.full((8,), 1.0))
    p.grad = torch.full((8,), 1e-30)
    counter = GradBytesCounter([p.grad])
    counter.add_state([p])
    with counter:
        torch.optim.SGD([p], lr=1e-3, foreach=True).step()
    assert torch.equal(p.detach(), torch.full((8,), 1.0))
    assert (counter.read, counter.written, counter.state_read, counter.state_written) == (
        32, 0, 32, 32,
    )  # fmt: skip
