"""The gradient-bytes counter of ``shardscale bench`` against counts made by hand.

Sizes are known (a 10x4 and a 6-element gradient, float32: G = 184 bytes), so
every expected value below is a multiple of G worked out from the op sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardscale.cli.bench import GradBytesCounter

G = (10 * 4 + 6) * 4


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(10, 4)), torch.nn.Parameter(torch.randn(6))]
    for p in params:
        p.grad = torch.randn_like(p) + 3.0  # no zeros: every write changes bits
    return params


def _adam(params: list[torch.nn.Parameter], grad_scale: torch.Tensor | None) -> None:
    zeros = [torch.zeros_like(p) for p in params]
    torch._fused_adam_(
        [p.data for p in params], [p.grad for p in params], zeros, [z.clone() for z in zeros], [],
        [torch.tensor(1.0) for _ in params], lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.0,
        eps=1e-8, amsgrad=False, maximize=False, grad_scale=grad_scale,
    )  # fmt: skip


def _grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


CASES: list[tuple[str, Callable[[list[torch.nn.Parameter]], Any], int, int]] = [
    ("foreach multiply: read and write each grad", lambda ps: torch._foreach_mul_(_grads(ps), 0.5), G, G),
    ("norm: one read", lambda ps: torch._foreach_norm(_grads(ps)), G, 0),
    ("dot(g, g) reads g once", lambda ps: [torch.dot(g.flatten(), g.flatten()) for g in _grads(ps)], G, 0),
    ("views move no data", lambda ps: [g.view(-1).t() for g in _grads(ps)], 0, 0),
    ("other tensors are not gradients", lambda ps: torch.randn(100) * 2, 0, 0),
    ("copy into a grad writes without reading it", lambda ps: ps[1].grad.copy_(torch.ones(6)), 0, 24),
    ("fused Adam without grad_scale reads only", lambda ps: _adam(ps, None), G, 0),
    ("fused Adam with grad_scale writes the unscaled grads back", lambda ps: _adam(ps, torch.tensor(8.0)), G, G),
    ("multiply by one writes equal bits: not seen", lambda ps: torch._foreach_mul_(_grads(ps), 1.0), G, 0),
    ("half a gradient", lambda ps: ps[0].grad[:5].mul_(2.0), 80, 80),
]  # fmt: skip


@pytest.mark.parametrize(("what", "ops", "read", "written"), CASES, ids=[c[0] for c in CASES])
def test_counts_match_the_hand_count(
    what: str, ops: Callable[[list[torch.nn.Parameter]], Any], read: int, written: int
) -> None:
    params = _params()
    with GradBytesCounter(_grads(params)) as counter:
        ops(params)
    assert (counter.read, counter.written) == (read, written), what


class _DataPtrHits(TorchDispatchMode):
    """An independent count: arguments that *are* one of the gradients (same data_ptr, same size)."""

    def __init__(self, grads: list[torch.Tensor]) -> None:
        super().__init__()
        self.grads = {(g.data_ptr(), g.numel()): g.numel() * g.element_size() for g in grads}
        self.read = 0
        self.written = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            values = value if isinstance(value, list | tuple) else [value]
            for t in values:
                if isinstance(t, torch.Tensor) and (t.data_ptr(), t.numel()) in self.grads:
                    self.read += self.grads[(t.data_ptr(), t.numel())]
                    if arg.alias_info is not None and arg.alias_info.is_write:
                        self.written += self.grads[(t.data_ptr(), t.numel())]
        return func(*args, **kwargs)


def _torch_recipe(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # creates the scale, as scale(loss) would
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(params, 1e-6)
    scaler.step(opt)
    scaler.update()


def test_torch_recipe_with_sgd_matches_data_ptr_hits_and_the_pass_count() -> None:
    # unscale (R+W), norm (R), clip multiply (R+W), SGD's read of the grads (R): 4 G read, 2 G written.
    counts = []
    for mode in (GradBytesCounter, _DataPtrHits):
        params = _params()
        opt = torch.optim.SGD(params, lr=0.1, foreach=True)
        with mode(_grads(params)) as counter:  # type: ignore[abstract]
            _torch_recipe(params, opt)
        counts.append((counter.read, counter.written))
    assert counts[0] == counts[1] == (4 * G, 2 * G)


def test_streaming_hooks_are_counted_only_while_active() -> None:
    params = _params()
    counter = GradBytesCounter(active=False)
    with counter:
        torch._foreach_norm(_grads(params))  # no gradients known yet, inactive: not counted
        counter.add(_grads(params))
        torch._foreach_norm(_grads(params))  # inactive: not counted
        counter.active = True
        torch._foreach_norm(_grads(params))
    assert (counter.read, counter.written) == (G, 0)
