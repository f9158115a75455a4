"""An unfused torch SGD/Adam/AdamW stepped through torch's fused kernel (``fuse_optimizer=True``).

Compared, in one process, with torch's own recipe on the same optimizer built
the same way: ``torch.amp.GradScaler`` + ``unscale_`` + ``clip_grad_norm_`` +
the unfused ``step``. Both arms get the *same* scaled gradients every step
(set directly, not from a backward through parameters that may differ by a
rounding), so their differences are the per-step roundings only.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from tolerances import clipped_grad_rtol
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode

from shardscale.core import ShardedGradScaler
from shardscale.core.scaler._optimizer_fusion import fusion_refusal

SHAPES = ((16, 12), (16,), (4, 16), (4,))
STEPS = 6
OVERFLOW = (0, 3)  # a skipped first step, and one later
SCALER_KW: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 2}
LR = 1e-2

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=LR, foreach=True),
    "sgd_loop": lambda p: torch.optim.SGD(p, lr=LR, foreach=False),
    "sgd_momentum_wd_nesterov": lambda p: torch.optim.SGD(
        p, lr=LR, momentum=0.9, weight_decay=0.01, nesterov=True
    ),
    "sgd_dampening_maximize": lambda p: torch.optim.SGD(
        p, lr=LR, momentum=0.5, dampening=0.3, maximize=True
    ),
    # eps=1e-3, not tiny: Adam's update is nearly scale-invariant, this makes it see the scale.
    "adam": lambda p: torch.optim.Adam(p, lr=LR, eps=1e-3),
    "adam_wd_maximize": lambda p: torch.optim.Adam(
        p, lr=LR, eps=1e-3, weight_decay=0.1, maximize=True
    ),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=LR, eps=1e-3, amsgrad=True),
}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in SHAPES]


def _grads() -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    steps = []
    for k in range(STEPS):
        # Growing gradients: a max_norm between their norms clips only some steps.
        grads = [torch.randn(s, generator=gen) * 0.01 * (0.5 + k) for s in SHAPES]
        if k in OVERFLOW:
            grads[k % len(SHAPES)].view(-1)[3] = math.inf
        steps.append(grads)
    return steps


def _max_norm(steps: list[list[torch.Tensor]]) -> float:
    norms = sorted(
        float(torch.nn.utils.get_total_norm(g)) for k, g in enumerate(steps) if k not in OVERFLOW
    )
    return norms[len(norms) // 2]


def _set_grads(params: list[torch.nn.Parameter], grads: list[torch.Tensor], scale: float) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g * scale  # a power of two: exactly the scaled gradient in both arms


def _numel() -> int:
    return sum(math.prod(s) for s in SHAPES)


def _bounds(name: str) -> tuple[float, float]:
    """(rtol, atol) for parameters and optimizer state after STEPS steps of the two arms.

    Per step the arms differ only in roundings: the unscaled, clipped gradient by
    ``clipped_grad_rtol`` (the kernel divides by scale/coef, torch multiplies by
    1/scale, then by coef), each parameter and state update by one float32 rounding
    per arm. A gradient error delta moves SGD's update by lr·|g|·delta, its momentum
    buffer by delta relatively (|buffer| <= max|g| / (1 - momentum)); Adam's moments
    by delta and 2·delta relatively and its update (|m/sqrt(v)| below ~32 for the
    default betas) by at most 2·delta of that. Summed over the steps.
    """
    delta = clipped_grad_rtol(_numel(), torch.float32, 2.0)
    eps = torch.finfo(torch.float32).eps
    rtol = STEPS * (2 * delta + 2 * eps)
    if name.startswith("sgd"):
        g_max = 0.01 * (0.5 + STEPS) * 5  # |randn| < 5 for these few hundred draws
        atol = STEPS * LR * (g_max / (1 - 0.9)) * 2 * delta
    else:
        atol = STEPS * LR * 32 * 2 * delta
    return rtol, atol


@contextlib.contextmanager
def _kernels() -> Iterator[set[str]]:
    """The names of torch's fused optimizer kernels run inside the block (torch's dispatch)."""
    ran: set[str] = set()

    class _Seen(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            name = func.overloadpacket.__name__
            if name.startswith("_fused_"):
                ran.add(name)
            return func(*args, **(kwargs or {}))

    with _Seen():
        yield ran


def _state(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    return [dict(opt.state[p]) for p in params if p in opt.state]


def _torch_recipe(name: str, steps: list[list[torch.Tensor]], max_norm: float) -> Any:
    params = _params()
    opt = OPTIMIZERS[name](params)
    scaler = torch.amp.GradScaler("cpu", **SCALER_KW)
    scaler.scale(torch.zeros(()))  # torch's scaler makes its scale here
    scales = []
    for grads in steps:
        opt.zero_grad()
        _set_grads(params, grads, scaler.get_scale())
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return params, opt, scales


def _ours(
    name: str, steps: list[list[torch.Tensor]], max_norm: float, **kw: Any
) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, list[float], list[bool]]:
    params = _params()
    opt = OPTIMIZERS[name](params)
    scaler = ShardedGradScaler("cpu", backend="local", **SCALER_KW, **kw)
    scales, folded = [], []
    for grads in steps:
        opt.zero_grad()
        _set_grads(params, grads, scaler.get_scale())
        scaler.unscale_(opt, max_norm=max_norm)
        folded.append(scaler._per_optimizer_states[id(opt)].folded)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return params, opt, scales, folded


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_parity_with_torchs_recipe_over_skipped_and_clipped_steps(name: str) -> None:
    steps = _grads()
    max_norm = _max_norm(steps)
    ref_params, ref_opt, ref_scales = _torch_recipe(name, steps, max_norm)
    params, opt, scales, folded = _ours(name, steps, max_norm, fuse_optimizer=True)
    # Momentum SGD takes the multiply path until its buffers exist (after the first step
    # that is not skipped); every other step ran through torch's fused kernel.
    first = 2 if opt.param_groups[0].get("momentum", 0) else 0
    assert folded == [False] * first + [True] * (STEPS - first)
    assert scales == ref_scales  # same skips, same growth and backoff
    rtol, atol = _bounds(name)
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol)
    ours, ref = _state(opt, params), _state(ref_opt, ref_params)
    assert [sorted(s) for s in ours] == [sorted(s) for s in ref]
    for s, r in zip(ours, ref, strict=True):
        for key in r:
            # The step counters (skipped steps not counted) are equal exactly.
            exact = key == "step"
            torch.testing.assert_close(
                s[key], r[key], rtol=0 if exact else rtol, atol=0 if exact else atol
            )
    # The flags the user built the optimizer with, unchanged.
    assert opt.param_groups[0]["fused"] in (None, False)
    assert opt.param_groups[0]["foreach"] == ref_opt.param_groups[0]["foreach"]


@pytest.mark.parametrize("name", ["sgd_momentum_wd_nesterov", "adamw_amsgrad"])
def test_a_skipped_step_changes_nothing(name: str) -> None:
    steps = _grads()
    params = _params()
    opt = OPTIMIZERS[name](params)
    scaler = ShardedGradScaler("cpu", backend="local", fuse_optimizer=True, **SCALER_KW)
    for k in (1, 2):  # two clean steps: every state exists, the kernel runs
        opt.zero_grad()
        _set_grads(params, steps[k], scaler.get_scale())
        scaler.unscale_(opt, max_norm=1e9)
        scaler.step(opt)
        scaler.update()
    before = [p.detach().clone() for p in params], copy.deepcopy(_state(opt, params))
    opt.zero_grad()
    _set_grads(params, steps[3], scaler.get_scale())  # holds an inf
    scaler.unscale_(opt, max_norm=1e9)
    assert scaler._per_optimizer_states[id(opt)].folded
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped is not None and bool(scaler.last_step_skipped)
    for p, b in zip(params, before[0], strict=True):
        assert torch.equal(p.detach(), b)
    for s, b in zip(_state(opt, params), before[1], strict=True):
        assert s.keys() == b.keys()
        assert all(torch.equal(s[k], b[k]) for k in s)


def test_a_plain_step_keeps_torchs_exact_numbers_unless_asked() -> None:
    steps = _grads()
    runs = {}
    for choice in (None, False, True):
        params = _params()
        opt = torch.optim.SGD(params, lr=LR)
        kw = {} if choice is None else {"fuse_optimizer": choice}
        scaler = ShardedGradScaler("cpu", backend="local", **kw, **SCALER_KW)
        ref_params = _params()
        ref_opt = torch.optim.SGD(ref_params, lr=LR)
        ref = torch.amp.GradScaler("cpu", **SCALER_KW)
        ref.scale(torch.zeros(()))
        for grads in steps:
            for ps, o, s in ((params, opt, scaler), (ref_params, ref_opt, ref)):
                o.zero_grad()
                _set_grads(ps, grads, s.get_scale())
                s.step(o)
                s.update()
        runs[choice] = [torch.equal(p, q) for p, q in zip(params, ref_params, strict=True)]
        assert scaler.get_scale() == ref.get_scale()
    assert all(runs[None])  # default: torch's unscale kernel, bit-identical
    assert all(runs[False])
    # True: dividing by a power-of-two scale is exact too, then the same SGD update.
    assert all(runs[True])


class _OwnStep(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return super().step(closure)


FALLBACKS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "overrides step": lambda p: _OwnStep(p, lr=LR),
    "differentiable": lambda p: torch.optim.SGD(p, lr=LR, differentiable=True),
    "not an SGD/Adam": lambda p: torch.optim.RMSprop(p, lr=LR),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_optimizers_the_kernel_cannot_run_take_the_multiply(case: str) -> None:
    steps = _grads()
    params = _params()
    opt = FALLBACKS[case](params)
    scaler = ShardedGradScaler("cpu", backend="local", **SCALER_KW)
    _set_grads(params, steps[1], scaler.get_scale())
    scaler.unscale_(opt, max_norm=1e9)
    assert not scaler._per_optimizer_states[id(opt)].folded
    for p, g in zip(params, steps[1], strict=True):
        assert torch.equal(p.grad, g)  # type: ignore[arg-type]  # multiplied by 1/2^10: exact
    # Asked for explicitly: every rank raises, naming why, before any gradient changes.
    strict = ShardedGradScaler("cpu", backend="local", fuse_optimizer=True, **SCALER_KW)
    _set_grads(params, steps[1], strict.get_scale())
    scaled = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="fuse_optimizer=True") as info:
        strict.unscale_(opt, max_norm=1e9)
    assert "torch's fused kernel" in str(info.value)
    assert all(torch.equal(p.grad, s) for p, s in zip(params, scaled, strict=True))  # type: ignore[arg-type]


def test_a_dtype_the_kernel_does_not_take_is_refused_by_torchs_own_test() -> None:
    # The engine itself takes real floating dtypes only, all of which torch's CPU kernels take:
    # the refusal is checked where it is decided.
    params = [torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))]
    why = fusion_refusal(torch.optim.SGD(params, lr=LR))
    assert why is not None and "complex64" in why
    assert fusion_refusal(torch.optim.SGD(_params(), lr=LR)) is None


def test_groups_and_attributes_are_restored_after_the_step_and_after_an_exception() -> None:
    params = _params()
    opt = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:], "foreach": True}], lr=LR)
    groups = copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    )
    attrs = set(vars(opt))
    scaler = ShardedGradScaler("cpu", backend="local", fuse_optimizer=True, **SCALER_KW)

    def check() -> None:
        assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
        assert [g["params"] for g in opt.param_groups] == [params[:2], params[2:]]
        assert set(vars(opt)) == attrs  # no grad_scale/found_inf/fused-check left behind

    _set_grads(params, _grads()[1], scaler.get_scale())
    scaler.unscale_(opt, max_norm=1.0)
    assert scaler._per_optimizer_states[id(opt)].folded
    with _kernels() as ran:
        scaler.step(opt)
    assert ran == {"_fused_adam_"}
    scaler.update()
    check()

    # A step that raises inside optimizer.step (a hook would refuse the fold: an argument
    # Adam.step does not take raises there, after the flags were set).
    _set_grads(params, _grads()[2], scaler.get_scale())
    scaler.unscale_(opt, max_norm=1.0)
    assert scaler._per_optimizer_states[id(opt)].folded
    with pytest.raises(TypeError, match="boom"):
        scaler.step(opt, boom=1)
    check()


def test_the_option_is_checked() -> None:
    with pytest.raises(TypeError, match="fuse_optimizer"):
        ShardedGradScaler("cpu", fuse_optimizer="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be True or False"):
        ShardedGradScaler("cpu", fuse_optimizer=1)  # type: ignore[arg-type]
    # The old automatic value names the change and the way forward.
    with pytest.raises(TypeError, match=r"fuse_optimizer=None\) is gone.*default is now False"):
        ShardedGradScaler("cpu", fuse_optimizer=None)  # type: ignore[arg-type]


def test_after_an_explicit_unscale_the_kernel_gets_no_grad_scale_and_the_grads_stay_unscaled() -> (
    None
):
    steps = _grads()
    params, ref_params = _params(), _params()
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_params, lr=LR, momentum=0.9)
    scaler = ShardedGradScaler("cpu", backend="local", fuse_optimizer=True, **SCALER_KW)
    ref = torch.amp.GradScaler("cpu", **SCALER_KW)
    ref.scale(torch.zeros(()))
    ran_fused: list[bool] = []
    for k in (1, 2, 3, 4):  # step 3 holds an inf
        for ps, o, s in ((params, opt, scaler), (ref_params, ref_opt, ref)):
            o.zero_grad()
            _set_grads(ps, steps[k], s.get_scale())
            s.unscale_(o)
        unscaled = [p.grad.clone() for p in params]  # type: ignore[union-attr]
        with _kernels() as ran:
            scaler.step(opt)
        ran_fused.append("_fused_sgd_" in ran or None)  # type: ignore[arg-type]
        ref.step(ref_opt)
        scaler.update()
        ref.update()
        # The kernel got grad_scale None: it left the unscaled gradients as they were.
        assert all(torch.equal(p.grad, u) for p, u in zip(params, unscaled, strict=True))  # type: ignore[arg-type]
    # The first step makes the momentum buffers (unfused, even with True: fused is as built),
    # then the kernel, the skipped step 3 included (it skips on the device, no host read).
    assert ran_fused == [None, True, True, True]
    assert scaler.get_scale() == ref.get_scale()
    rtol, atol = _bounds("sgd_momentum")
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", ["sgd", "sgd_momentum_wd_nesterov", "adamw_amsgrad"])
def test_the_default_steps_the_optimizer_as_built(name: str) -> None:
    steps = _grads()
    max_norm = _max_norm(steps)
    ref_params, _, ref_scales = _torch_recipe(name, steps, max_norm)
    with _kernels() as ran:
        params, _, scales, folded = _ours(name, steps, max_norm)
    assert folded == [False] * STEPS
    assert ran == set()  # the optimizer's own foreach/loop step, never torch's fused kernel
    assert scales == ref_scales
    rtol, atol = _bounds(name)  # the clip's multiply by coef / scale: its rounding only
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol)


def _clear_state_in_place(opt: torch.optim.Optimizer) -> None:
    for st in opt.state.values():
        st.clear()


@pytest.mark.parametrize("name", ["sgd_momentum_wd_nesterov", "sgd_dampening_maximize"])
def test_state_cleared_in_place_then_an_overflow_matches_torchs_recipe(name: str) -> None:
    # Issue 27, attack 2: the checks were keyed on the state dict's identity and length, so a
    # state cleared in place kept "every momentum buffer exists": the kernel then made the
    # buffers on a skipped step, uninitialised (parameters 1e16-1e37 off).
    steps = _grads()
    max_norm = _max_norm(steps)
    order = [1, 2, 3, 4, 5]  # step 3 holds an inf; the state is cleared just before it
    arms = []
    for ours in (True, False):
        params = _params()
        opt = OPTIMIZERS[name](params)
        scaler: Any = (
            ShardedGradScaler("cpu", backend="local", fuse_optimizer=True, **SCALER_KW)
            if ours
            else torch.amp.GradScaler("cpu", **SCALER_KW)
        )
        scaler.scale(torch.zeros(()))
        folded = []
        for k in order:
            if k == 3:
                _clear_state_in_place(opt)
            opt.zero_grad()
            _set_grads(params, steps[k], scaler.get_scale())
            if ours:
                scaler.unscale_(opt, max_norm=max_norm)
                folded.append(scaler._per_optimizer_states[id(opt)].folded)
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, max_norm)
            scaler.step(opt)
            scaler.update()
        arms.append((params, opt, scaler.get_scale(), folded))
    (params, opt, scale, folded), (ref_params, ref_opt, ref_scale, _) = arms
    assert scale == ref_scale
    rtol, atol = _bounds(name)
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol)
    for s, r in zip(_state(opt, params), _state(ref_opt, ref_params), strict=True):
        assert s.keys() == r.keys()
        torch.testing.assert_close(s["momentum_buffer"], r["momentum_buffer"], rtol=rtol, atol=atol)
    # The buffers exist from the first step on, are cleared before step 3 (which is skipped:
    # no buffers made) and made again by step 4, unfused; the kernel runs again from step 5.
    assert folded == [False, True, False, False, True]


def test_the_checks_notice_each_change_they_depend_on() -> None:
    # Each change below alters what the per-parameter checks read; the owner's remembered
    # answer must follow (compared with the checks run afresh) without any other change.
    from shardscale.core.scaler._optimizer_fusion import (
        FIRST_MOMENTUM_STEP,
        STEP_HOOKS,
        FusionChecks,
    )

    checks = FusionChecks()

    def agrees(opt: torch.optim.Optimizer) -> str | None:
        answer = checks.refusal(opt)
        assert answer == fusion_refusal(opt)
        return answer

    def momentum_sgd() -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
        params = _params()
        opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
        _set_grads(params, _grads()[1], 1.0)
        opt.step()  # every momentum buffer exists
        return params, opt

    params, sgd = momentum_sgd()
    assert agrees(sgd) is None
    # State cleared in place (the dict and its length unchanged).
    _clear_state_in_place(sgd)
    assert agrees(sgd) == FIRST_MOMENTUM_STEP
    sgd.step()
    assert agrees(sgd) is None
    # One buffer replaced by hand.
    sgd.state[params[2]]["momentum_buffer"] = None
    assert agrees(sgd) == FIRST_MOMENTUM_STEP
    sgd.state[params[2]]["momentum_buffer"] = torch.zeros_like(params[2])
    assert agrees(sgd) is None
    # load_state_dict of an optimizer that never stepped (no buffers).
    fresh = torch.optim.SGD(_params(), lr=LR, momentum=0.9)
    sgd.load_state_dict(fresh.state_dict())
    assert agrees(sgd) == FIRST_MOMENTUM_STEP
    # A group flag flipped: momentum on an SGD without buffers, then differentiable.
    params, plain = _params(), None
    plain = torch.optim.SGD(params, lr=LR)
    _set_grads(params, _grads()[1], 1.0)
    assert agrees(plain) is None
    plain.param_groups[0]["momentum"] = 0.9
    assert agrees(plain) == FIRST_MOMENTUM_STEP
    plain.param_groups[0]["momentum"] = 0
    plain.param_groups[0]["differentiable"] = True
    assert "differentiable" in (agrees(plain) or "")
    plain.param_groups[0]["differentiable"] = False
    assert agrees(plain) is None
    # A parameter changed in place (as module.to() does), or replaced in the group's list.
    saved = params[1].data
    params[1].data = saved.to(torch.complex64)
    assert "complex64" in (agrees(plain) or "")
    params[1].data = saved
    assert agrees(plain) is None
    plain.param_groups[0]["params"][3] = torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64))
    assert "complex64" in (agrees(plain) or "")
    plain.param_groups[0]["params"][3] = params[3]
    assert agrees(plain) is None
    # A gradient of another dtype than its parameter (gradients change every step).
    params[0].grad_dtype = None  # torch 2.13 refuses such a gradient unless told
    params[0].grad = params[0].grad.double()  # type: ignore[union-attr]
    assert "gradient" in (agrees(plain) or "")
    params[0].grad = params[0].grad.float()  # type: ignore[union-attr]
    assert agrees(plain) is None
    # Adam: a step counter replaced by one the kernel cannot take.
    params = _params()
    adam = torch.optim.Adam(params, lr=LR)
    _set_grads(params, _grads()[1], 1.0)
    adam.step()
    assert agrees(adam) is None
    adam.state[params[0]]["step"] = torch.tensor(1.0, dtype=torch.float64)
    assert "step counters" in (agrees(adam) or "")
    adam.state[params[0]]["step"] = torch.tensor(1.0)
    assert agrees(adam) is None
    # Step hooks, the optimizer's and torch's global ones, for as long as they are registered.
    for register in (
        adam.register_step_pre_hook,
        adam.register_step_post_hook,
        register_optimizer_step_pre_hook,
        register_optimizer_step_post_hook,
    ):
        handle = register(lambda *_: None)
        try:
            assert agrees(adam) == STEP_HOOKS
        finally:
            handle.remove()
        assert agrees(adam) is None


CLIP_VALUE = 0.02  # between the gradients' magnitudes: some entries are clipped every step


def _hooked_run(
    name: str, ours: bool, *, late: bool = False, max_norm: float | None = None
) -> tuple[list[torch.nn.Parameter], list[list[torch.Tensor]], list[float], list[bool]]:
    """Steps with a pre-hook that clips values (what it saw recorded), ours or torch's recipe."""
    steps = _grads()
    params = _params()
    opt = OPTIMIZERS[name](params)
    seen: list[list[torch.Tensor]] = []

    def clip_values(o: torch.optim.Optimizer, *_: Any) -> None:
        seen.append([p.grad.clone() for p in params])  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_value_(params, CLIP_VALUE)

    if not late:
        opt.register_step_pre_hook(clip_values)
    scaler: Any = (
        ShardedGradScaler("cpu", backend="local", fuse_optimizer=True, **SCALER_KW)
        if ours
        else torch.amp.GradScaler("cpu", **SCALER_KW)
    )
    scaler.scale(torch.zeros(()))
    scales, folded = [], []
    for grads in steps:
        opt.zero_grad()
        _set_grads(params, grads, scaler.get_scale())
        if max_norm is not None and ours:
            scaler.unscale_(opt, max_norm=max_norm)
        elif max_norm is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        if ours:
            folded.append(scaler._per_optimizer_states[id(opt)].folded)
        if late and not opt._optimizer_step_pre_hooks:
            opt.register_step_pre_hook(clip_values)  # after unscale_and_clip_ left them scaled
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return params, seen, scales, folded


@pytest.mark.parametrize("name", ["sgd", "adamw_amsgrad"])
def test_a_step_pre_hook_that_clips_values_sees_torchs_gradients(name: str) -> None:
    # Issue 27, attack 3: with the apply folded the hook saw gradients multiplied by the loss
    # scale (and clipped those): 5e-3 (SGD) and 2e-2 (AdamW) off torch's recipe in 5 steps.
    steps = _grads()
    max_norm = _max_norm(steps)
    params, seen, scales, folded = _hooked_run(name, True, max_norm=max_norm)
    ref_params, ref_seen, ref_scales, _ = _hooked_run(name, False, max_norm=max_norm)
    assert folded == [False] * STEPS  # hooks registered: the multiply, even with True
    assert scales == ref_scales
    # The hook ran on the steps taken only, as in torch's recipe (not on the skipped ones).
    assert len(seen) == len(ref_seen) == STEPS - len(OVERFLOW)
    # What the hook saw: the unscaled, clipped gradients, to the clip's rounding.
    delta = clipped_grad_rtol(_numel(), torch.float32, 2.0)
    for ours, ref in zip(seen, ref_seen, strict=True):
        for g, r in zip(ours, ref, strict=True):
            torch.testing.assert_close(g, r, rtol=delta, atol=0)
    rtol, atol = _bounds(name)
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", ["sgd", "adamw_amsgrad"])
def test_a_step_pre_hook_on_a_plain_step_keeps_torchs_exact_numbers(name: str) -> None:
    params, seen, scales, _ = _hooked_run(name, True)
    ref_params, ref_seen, ref_scales, _ = _hooked_run(name, False)
    assert scales == ref_scales
    # torch's unscale kernel on both sides (the fold is refused): bit for bit.
    assert all(
        torch.equal(g, r)
        for s, t in zip(seen, ref_seen, strict=True)
        for g, r in zip(s, t, strict=True)
    )
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params, strict=True))


def test_a_hook_registered_after_unscale_and_clip_sees_unscaled_gradients() -> None:
    steps = _grads()
    max_norm = _max_norm(steps)
    params, seen, scales, folded = _hooked_run("sgd", True, late=True, max_norm=max_norm)
    ref_params, ref_seen, ref_scales, _ = _hooked_run("sgd", False, late=True, max_norm=max_norm)
    assert folded[0] is True  # left scaled for the kernel; then the hook came: divided back
    assert scales == ref_scales
    assert len(seen) == len(ref_seen)
    # The kernel's division by scale / coef against torch's two multiplies: the clip's rounding.
    delta = clipped_grad_rtol(_numel(), torch.float32, 2.0)
    for ours, ref in zip(seen, ref_seen, strict=True):
        for g, r in zip(ours, ref, strict=True):
            torch.testing.assert_close(g, r, rtol=delta, atol=0)
    rtol, atol = _bounds("sgd")
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", ["sgd", "adamw_amsgrad"])
def test_a_state_dict_taken_in_a_post_hook_records_the_users_flags(name: str) -> None:
    # Issue 27, attack 3: it recorded fused=True, and an optimizer loading it became fused.
    steps = _grads()
    params = _params()
    opt = OPTIMIZERS[name](params)
    built = [{k: g.get(k) for k in ("fused", "foreach")} for g in opt.param_groups]
    saved: list[dict[str, Any]] = []
    opt.register_step_post_hook(lambda o, *_: saved.append(o.state_dict()))
    scaler = ShardedGradScaler("cpu", backend="local", fuse_optimizer=True, **SCALER_KW)
    for grads in steps[1:3]:
        opt.zero_grad()
        _set_grads(params, grads, scaler.get_scale())
        scaler.unscale_(opt, max_norm=1e9)
        scaler.step(opt)
        scaler.update()
    assert len(saved) == 2
    for sd in saved:
        assert [{k: g.get(k) for k in ("fused", "foreach")} for g in sd["param_groups"]] == built
    other = OPTIMIZERS[name](_params())
    other.load_state_dict(saved[-1])
    assert not other.param_groups[0]["fused"]


def test_a_copied_or_pickled_scaler_checks_again() -> None:
    import pickle

    steps = _grads()
    params = _params()
    opt = torch.optim.SGD(params, lr=LR)
    scaler = ShardedGradScaler("cpu", backend="local", fuse_optimizer=True, **SCALER_KW)
    _set_grads(params, steps[1], scaler.get_scale())
    scaler.unscale_(opt, max_norm=1e9)
    scaler.step(opt)
    scaler.update()
    for copied in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        _set_grads(params, steps[2], copied.get_scale())
        copied.unscale_(opt, max_norm=1e9)
        assert copied._per_optimizer_states[id(opt)].folded
        with _kernels() as ran:
            copied.step(opt)
        assert ran == {"_fused_sgd_"}
        copied.update()
