"""The step plan in one process: a warm step gives what a cold one gives, and holds nothing.

Each case runs a sequence of steps on one set of parameters (warm whenever
the plan still holds) and, for every step, the same step on a fresh copy of
the parameters (new tensors: always cold), and compares the two bit for bit:
the norm, found_inf and every gradient after the multiply. Between steps the
layout changes the ways a training loop changes it. FSDP2 (DTensor) layouts
and declarations across ranks are in integration_tests/test_step_plan.py.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import torch

from shardscale.core import get_registry
from shardscale.core.step import Apply, StepConfig, StepPlans, StepRequest, run_step
from shardscale.core.step._aliasing import AliasedGradientError

SCALE = 1024.0


def _config(**kw: object) -> StepConfig:
    registry = get_registry()
    return StepConfig(backend=registry.make_backend("local"), registry=registry, **kw)  # type: ignore[arg-type]


def _params(n: int = 6, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for i in range(n):
        p = torch.nn.Parameter(torch.randn(3 + i, generator=gen))
        p.grad = torch.randn(3 + i, generator=gen) * SCALE
        params.append(p)
    return params


def _copy(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


def _step(
    params: list[torch.nn.Parameter], config: StepConfig, plans: StepPlans | None
) -> tuple[torch.Tensor, ...]:
    result = run_step(
        params, config, StepRequest(apply=Apply.MULTIPLY, norm_type=2.0, max_norm=0.5,
        scale=torch.tensor(SCALE), plans=plans),
    )  # fmt: skip
    assert result.norm is not None
    return result.norm, result.found_inf


def _same_as_cold(live: list[torch.nn.Parameter], config: StepConfig, plans: StepPlans) -> None:
    cold = _copy(live)  # new tensors, and no plans kept: always cold
    got, want = _step(live, config, plans), _step(cold, config, None)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    for p, q in zip(live, cold, strict=True):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert q.grad is not None
            dense = (p.grad.to_dense(), q.grad.to_dense()) if p.grad.is_sparse else (p.grad, q.grad)
            assert torch.equal(*dense)


def _uses(plans: StepPlans) -> list[int]:
    return [plan.uses for plan in plans]


def _regrad(params: list[torch.nn.Parameter]) -> None:
    """Fresh gradients of the same layout (zero_grad(set_to_none=True) and a backward)."""
    gen = torch.Generator().manual_seed(len(params))
    for p in params:
        if p.grad is not None:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype) * SCALE


def test_a_warm_step_reuses_the_plan_and_matches_a_cold_one() -> None:
    live, config, plans = _params(), _config(), StepPlans()
    _same_as_cold(live, config, plans)
    assert _uses(plans) == [0]  # built, not yet reused
    for k in range(3):
        _regrad(live)
        _same_as_cold(live, config, plans)
        assert _uses(plans) == [k + 1]


def test_a_step_without_plans_keeps_none() -> None:
    live, config, plans = _params(), _config(), StepPlans()
    _step(live, config, None)
    _regrad(live)
    _step(live, config, plans)
    assert _uses(plans) == [0]  # the step without plans left nothing to reuse


def _drop_a_grad(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    params[2].grad = None
    return params


def _add_a_param(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    extra = torch.nn.Parameter(torch.randn(4))
    extra.grad = torch.randn(4) * SCALE
    return [*params, extra]


def _change_a_dtype(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    p = params[1]
    p.data = p.data.double()
    p.grad = torch.randn(p.shape, dtype=torch.float64) * SCALE
    return params


def _make_a_grad_sparse(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    p = params[3]
    assert p.grad is not None
    dense = p.grad.clone()
    # Duplicate indices: the norm must see them coalesced, as on a cold step.
    index = torch.tensor([[0, 0, *range(p.numel())]])
    values = torch.cat([dense[:1] / 2, dense[:1] / 2, dense])
    values[2] = 0.0
    p.grad = torch.sparse_coo_tensor(index, values, p.shape, check_invariants=True)
    return params


def _reorder(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return params[::-1]


@pytest.mark.parametrize(
    "change", [_drop_a_grad, _add_a_param, _change_a_dtype, _make_a_grad_sparse, _reorder]
)
def test_a_change_between_steps_rebuilds_and_matches_a_cold_step(
    change: Callable[[list[torch.nn.Parameter]], list[torch.nn.Parameter]],
) -> None:
    live, config, plans = _params(), _config(), StepPlans()
    _same_as_cold(live, config, plans)
    _regrad(live)
    _same_as_cold(live, config, plans)  # warm
    first = list(plans)
    live = change(live)
    _same_as_cold(live, config, plans)  # the change is seen: the result is the cold step's
    _regrad(live)
    _same_as_cold(live, config, plans)  # and the step after it too
    if change is not _make_a_grad_sparse:  # sparse layouts are never planned
        assert list(plans) and list(plans)[-1] not in first


def test_a_different_declaration_gets_its_own_plan() -> None:
    live, plans = _params(), StepPlans()
    plain, own = _config(), _config(distinct_params=frozenset({id(live[0])}))
    for _ in range(2):
        for config in (plain, own):
            _regrad(live)
            _step(live, config, plans)
    # One plan per declaration, each reused once: neither was taken for the other.
    assert sorted(_uses(plans)) == [1, 1]


def test_aliased_grads_are_refused_on_a_warm_step() -> None:
    # Grads that share memory keep every class, shape and device the plan checks: the aliasing
    # check must still run on every step.
    live, config, plans = _params(), _config(), StepPlans()
    _step(live, config, plans)
    _regrad(live)
    _step(live, config, plans)
    before = [p.grad.clone() for p in live]  # type: ignore[union-attr]
    live[3].grad = live[4].grad[:6]  # type: ignore[index]  # the same first element
    with pytest.raises(AliasedGradientError, match="share one gradient tensor"):
        _step(live, config, plans)
    for p, g in zip(live[4:], before[4:], strict=True):
        assert torch.equal(p.grad, g)  # type: ignore[arg-type]  # nothing was written


def test_a_plan_holds_no_gradient_and_its_parameters_only_while_its_owner_lives() -> None:
    live, config, plans = _params(), _config(), StepPlans()
    for _ in range(2):
        _step(live, config, plans)
        _regrad(live)
    grads = [weakref.ref(p.grad) for p in live]  # type: ignore[arg-type]
    for param in live:
        param.grad = None  # zero_grad(set_to_none=True)
    del param
    gc.collect()
    assert all(g() is None for g in grads)
    params = [weakref.ref(p) for p in live]
    del live
    gc.collect()
    assert all(p() is not None for p in params)  # the plans' owner still steps them
    del plans
    gc.collect()
    assert all(p() is None for p in params)


def test_a_plan_leaves_its_parameters_swappable() -> None:
    # torch.utils.swap_tensors (module.to() on DTensor parameters, or on any parameter under
    # torch.__future__.set_swap_module_params_on_conversion) refuses a tensor with a weak
    # reference: a warm plan must hold none, and a swapped parameter must not pass for itself.
    live, config, plans = _params(), _config(), StepPlans()
    for _ in range(2):
        _step(live, config, plans)
        _regrad(live)
    for param in live:
        assert not weakref.getweakrefs(param)
        grad = param.grad
        param.grad = None
        torch.utils.swap_tensors(param, torch.nn.Parameter(param.detach().double()))
        param.grad = None if grad is None else grad.double()
    assert all(p.dtype == torch.float64 for p in live)
    _same_as_cold(live, config, plans)  # the same objects, another dtype: seen, rebuilt


def test_a_replaced_parameter_rebuilds() -> None:
    live, config, plans = _params(), _config(), StepPlans()
    _step(live, config, plans)
    (plan,) = plans
    live[5] = torch.nn.Parameter(torch.randn(8))  # another tensor in its place
    live[5].grad = torch.randn(8) * SCALE
    _same_as_cold(live, config, plans)
    assert list(plans) == [plans.find(plan.key, plan.catalog)]
    assert plan not in list(plans) and plan.uses == 0  # replaced, never reused


def test_plans_keep_at_most_their_limit() -> None:
    with pytest.raises(ValueError, match="keep at least one plan"):
        StepPlans(limit=0)
    live, plans = _params(), StepPlans(limit=1)
    plain, own = _config(), _config(distinct_params=frozenset({id(live[0])}))
    _step(live, plain, plans)
    _step(live, own, plans)
    assert len(plans) == 1  # the second key pushed the first out
    _regrad(live)
    _step(live, plain, plans)
    assert _uses(plans) == [0]  # so the first key's step ran cold again


def test_registering_an_adapter_between_steps_rebuilds() -> None:
    from shardscale.core import GradShard, hookimpl

    class _NoCount:
        name = "no-count"
        priority = 100

        def claims(self, param: torch.Tensor) -> bool:
            return getattr(param, "_not_counted", False) is True

        def describe(self, param: torch.Tensor, grad: torch.Tensor, ctx: object) -> GradShard:
            return GradShard(local=grad, counts=False, ranks=None)

    class _Plugin:
        @hookimpl
        def shardscale_grad_adapters(self) -> list[object]:
            return [_NoCount()]

    live, config, plans = _params(), _config(), StepPlans()
    live[0]._not_counted = True  # type: ignore[attr-defined]
    _step(live, config, plans)  # the plain adapter counts live[0]: that is the plan
    registry = get_registry()
    name = registry.register(_Plugin(), name="no-count")
    try:
        _regrad(live)
        cold, unmarked = _copy(live), _copy(live)
        cold[0]._not_counted = True  # type: ignore[attr-defined]
        got, want = _step(live, config, plans)[0], _step(cold, config, None)[0]
        counted = _step(unmarked, config, None)[0]  # what the old plan would have said
        assert torch.equal(got, want)
        assert not torch.equal(got, counted)
        assert all(plan.uses == 0 for plan in plans)  # rebuilt, not reused
    finally:
        registry.unregister(name)


def test_an_adapter_with_layout_keys_is_asked_once_per_layout() -> None:
    from shardscale.core import GradShard, hookimpl

    class _PerParam:
        name = "per-param"
        priority = 100
        stable_layout = True

        def __init__(self) -> None:
            self.calls = 0

        def claims(self, param: torch.Tensor) -> bool:
            return getattr(param, "_layout", None) is not None

        def describe(self, param: torch.Tensor, grad: torch.Tensor, ctx: object) -> GradShard:
            self.calls += 1
            return GradShard(local=grad, counts=param._layout == "a", ranks=None)  # type: ignore[attr-defined]

    class _PerLayout(_PerParam):
        name = "per-layout"

        def layout_keys(
            self, params: list[torch.Tensor], grads: list[torch.Tensor], ctx: object
        ) -> list[str]:
            return [p._layout for p in params]  # type: ignore[attr-defined]

    def run(adapter: _PerParam) -> tuple[torch.Tensor, list[torch.Tensor]]:
        class _Plugin:
            @hookimpl
            def shardscale_grad_adapters(self) -> list[object]:
                return [adapter]

        live = _params(12)
        for i, p in enumerate(live):
            p._layout = "ab"[i % 2]  # type: ignore[attr-defined]
        registry = get_registry()
        name = registry.register(_Plugin(), name=adapter.name)
        plans = StepPlans()
        try:
            norm = _step(live, _config(), plans)[0]
            cold_calls = adapter.calls
            _regrad(live)
            _step(live, _config(), plans)
            assert adapter.calls == cold_calls  # warm: no adapter call at all
        finally:
            registry.unregister(name)
        return norm, [p for p in live if p._layout == "a"]  # type: ignore[attr-defined]

    per_layout, per_param = _PerLayout(), _PerParam()
    got, _ = run(per_layout)
    want, counted = run(per_param)
    assert per_layout.calls == 2 and per_param.calls == 12
    assert torch.equal(got, want)
    # torch's float64 norm of the counted gradients as first given (same seed), unscaled.
    grads = [g.grad for g in _params(12)][0::2]
    ref = torch.linalg.vector_norm(torch.cat([g.double() for g in grads])) / SCALE  # type: ignore[union-attr]
    numel = sum(g.numel() for g in grads)  # type: ignore[union-attr]
    # float32 accumulation of ~60 squares and of 6 per-tensor norms: (n + 8)·u·2 + u.
    u = torch.finfo(torch.float32).eps / 2
    assert abs(float(got) - float(ref)) <= ((numel + 8) * u * 2 + u) * float(ref)
    assert len(counted) == 6
