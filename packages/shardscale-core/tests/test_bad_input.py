"""Bad input to every public entry point: a clear error, and nothing changed.

Table-driven: each :class:`Case` builds a fresh little training world (a model's
parameters with gradients, one or two optimizers, a scaler at some point of its
iteration, the process registry -- fresh for each test, see
:func:`_fresh_process_registry`), takes a snapshot of every piece of state a user
could care about, performs one bad call and checks

* the exception type,
* that the message names the problem (``problem``) and how to fix it (``fix``),
* that the snapshot is unchanged: scale, growth tracker, hysteresis tracker,
  factors, per-optimizer stage and overflow flags, gradients, parameters,
  optimizer state and the registry's plugins.

Cases for packages that may not be installed (clip, collectives, the CLI) are
skipped when the package is absent, so ``nox -s isolated`` for core still runs
this file. Layouts that need a process group (parameters over meshes no
adapter can combine) are in integration_tests/test_faults.py.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
import torch

from shardscale.core import (
    BackendUnavailableError,
    Layout,
    LayoutError,
    LossCheck,
    PluginConflictError,
    PluginNotFoundError,
    ReduceOp,
    Registry,
    ScaleBounds,
    ScalerStateError,
    ShardedGradScaler,
    ShardscaleError,
    SkipStreakLimit,
    SpikeSkip,
    get_registry,
    hookimpl,
)
from shardscale.core.plugins import CompletedHandle, reset_registry
from shardscale.core.scaler import OptState


@pytest.fixture(autouse=True)
def _fresh_process_registry() -> Iterator[None]:
    """Each test's scalers use the process registry (as every scaler does), fresh for the test.

    The plugins a case registers in-process live on it; it is forgotten after
    the test, so none outlives its case.
    """
    reset_registry()
    try:
        yield
    finally:
        reset_registry()


# --------------------------------------------------------------------------------------------
# the world a case acts on


@dataclass
class World:
    """Everything a bad call could disturb."""

    scaler: ShardedGradScaler
    params: list[torch.Tensor]
    optimizers: list[torch.optim.Optimizer]
    registry: Registry
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def opt(self) -> torch.optim.Optimizer:
        return self.optimizers[0]


_STAGES = ("fresh", "scaled", "unscaled", "stepped", "updated")


def make_world(
    stage: str = "scaled",
    *,
    extra_params: Sequence[torch.Tensor] = (),
    scaler_kwargs: dict[str, Any] | None = None,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
    registry: Registry | None = None,
) -> World:
    """A two-layer model's parameters with scaled grads, an SGD optimizer and a scaler.

    ``stage`` is how far the current iteration got before the bad call:
    ``fresh`` (scale() never called), ``scaled`` (backward done), ``unscaled``,
    ``stepped`` or ``updated`` (one whole iteration, then backward again).
    """
    assert stage in _STAGES
    torch.manual_seed(0)
    reg = registry if registry is not None else get_registry()
    kwargs = {"growth_interval": 3, "backend": "local", **(scaler_kwargs or {})}
    scaler = ShardedGradScaler("cpu", **kwargs)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params: list[torch.Tensor] = [*model.parameters(), *extra_params]
    make_opt = optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    opt = make_opt(params)
    world = World(scaler, params, [opt], reg)

    def backward() -> None:
        x = torch.randn(5, 4)
        loss = model(x).square().mean()
        scaler.scale(loss).backward()

    if stage == "fresh":
        return world
    backward()
    if stage == "updated":
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        backward()
        return world
    if stage in ("unscaled", "stepped"):
        scaler.unscale_(opt)
    if stage == "stepped":
        scaler.step(opt)
    return world


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Bit patterns, so that nan == nan and -0.0 != 0.0: "unchanged" means unchanged.
    t = t.detach()
    if t.is_sparse:
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().reshape(-1).view(torch.uint8).clone() if t.numel() else t.clone()


def _tensor_or_none(
    t: torch.Tensor | None,
) -> tuple[str, str, tuple[int, ...], torch.Tensor] | None:
    if t is None:
        return None
    if t.device.type == "meta":
        return (str(t.dtype), "meta", tuple(t.shape), torch.empty(0))
    return (str(t.dtype), str(t.device), tuple(t.shape), _bits(t))


def _optim_state(opt: torch.optim.Optimizer) -> Any:
    sd = copy.deepcopy(opt.state_dict())
    return sd


def snapshot(world: World) -> dict[str, Any]:
    """Every piece of state a failed call must leave alone."""
    s = world.scaler
    opt_states = {}
    for key, st in s._per_optimizer_states.items():
        # An untouched READY entry is indistinguishable from no entry (torch's defaultdict
        # creates the same on any access); anything else is state.
        flags = st["found_inf_per_device"]
        if st["stage"] is OptState.READY and not flags and st.grad_scale is None:
            continue
        found = {str(d): _tensor_or_none(f) for d, f in flags.items()}
        opt_states[key] = (st["stage"], found, _tensor_or_none(st.grad_scale))
    return {
        "scale": _tensor_or_none(s._scale),
        "growth_tracker": _tensor_or_none(s._growth_tracker),
        "hysteresis_tracker": _tensor_or_none(s._hysteresis_tracker),
        "config": (
            s._enabled,
            s._init_scale,
            s._growth_factor,
            s._backoff_factor,
            s._growth_interval,
            s._init_growth_tracker,
            s._hysteresis,
            s._init_hysteresis_tracker,
            s._min_scale,
            s._max_scale,
            s._step_count,
            s._distinct_dims,
            s._kernels_name,
        ),
        "optimizer_states": opt_states,
        "grads": [_tensor_or_none(p.grad) for p in world.params],
        "params": [_tensor_or_none(p) for p in world.params],
        "optimizers": [_optim_state(o) for o in world.optimizers],
        "plugins": [(p.name, p.distribution, p.hooks) for p in world.registry.plugins()],
        "backends": world.registry.names("backend"),
        "middlewares": world.registry.names("middleware"),
    }


def assert_same(before: Any, after: Any, path: str = "state") -> None:
    """Structural equality that compares tensors bit for bit."""
    if isinstance(before, torch.Tensor):
        assert isinstance(after, torch.Tensor), path
        assert before.dtype == after.dtype and before.shape == after.shape, path
        assert torch.equal(before, after), f"{path} changed"
    elif isinstance(before, dict):
        assert isinstance(after, dict) and before.keys() == after.keys(), f"{path} keys changed"
        for k in before:
            assert_same(before[k], after[k], f"{path}[{k!r}]")
    elif isinstance(before, (list, tuple)):
        assert type(before) is type(after) and len(before) == len(after), f"{path} changed"
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            assert_same(b, a, f"{path}[{i}]")
    elif isinstance(before, float) and math.isnan(before):
        assert isinstance(after, float) and math.isnan(after), f"{path} changed"
    else:
        assert before == after, f"{path} changed: {before!r} -> {after!r}"


# --------------------------------------------------------------------------------------------
# in-process plugins used by the registry cases


class _TapMiddleware:
    """A pass-through middleware, registered in-process under the name ``tap``."""

    name: ClassVar[str] = "tap"

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def all_reduce(self, tensor: torch.Tensor, *, op: ReduceOp, group: Any) -> Any:
        return self.inner.all_reduce(tensor, op=op, group=group)

    def world_size(self, group: Any) -> int:
        return int(self.inner.world_size(group))

    def rank(self, group: Any) -> int:
        return int(self.inner.rank(group))

    def group_ranks(self, group: Any) -> tuple[int, ...]:
        return tuple(self.inner.group_ranks(group))


def _backend_class(backend_name: str) -> type:
    class _Backend:
        name: ClassVar[str] = backend_name

        def all_reduce(self, tensor: torch.Tensor, *, op: ReduceOp, group: Any) -> Any:
            del tensor, op, group
            return CompletedHandle()

        def world_size(self, group: Any) -> int:
            return 1

        def rank(self, group: Any) -> int:
            return 0

        def group_ranks(self, group: Any) -> tuple[int, ...]:
            return (0,)

    return _Backend


class _TapPlugin:
    @hookimpl
    def shardscale_middlewares(self) -> list[type]:
        return [_TapMiddleware]


class _DupPlugin:
    """Claims a backend name another in-process plugin also claims."""

    def __init__(self) -> None:
        self.cls = _backend_class("dup")

    @hookimpl
    def shardscale_collective_backends(self) -> list[type]:
        return [self.cls]


class _NamelessPlugin:
    @hookimpl
    def shardscale_collective_backends(self) -> list[object]:
        return [object()]


def _with_plugins(*plugins: tuple[object, str]) -> Callable[[], World]:
    def setup() -> World:
        reg = get_registry()
        for plugin, name in plugins:
            reg.register(plugin, name=name)
        return make_world("scaled", registry=reg)

    return setup


def _while_registered(
    world: World, plugin: object, name: str, act: Callable[[World], object]
) -> object:
    world.registry.register(plugin, name=name)
    try:
        return act(world)
    finally:
        world.registry.unregister(name)


class _LegacyFusedSGD(torch.optim.SGD):
    """An optimizer that still takes torch's deprecated ``grad_scaler=`` argument."""

    _step_supports_amp_scaling = True

    def step(self, closure: Any = None, grad_scaler: Any = None) -> Any:  # type: ignore[override]
        del grad_scaler
        return super().step(closure)


class _Unclaimed(torch.Tensor):
    """A tensor subclass no installed adapter knows."""


def _unclaimed_param() -> torch.Tensor:
    p = torch.Tensor._make_subclass(_Unclaimed, torch.ones(2), True)
    p.grad = torch.ones(2)
    return p


def _int_param() -> torch.Tensor:
    p = torch.zeros(3, dtype=torch.int64)
    p.grad = torch.ones(3, dtype=torch.int64)
    return p


def _complex_param() -> torch.Tensor:
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    p.grad = torch.full((3,), 2.0 + 1.0j, dtype=torch.complex64)
    return p


def _cuda_param() -> torch.Tensor:
    p = torch.nn.Parameter(torch.zeros(3, device="cuda"))
    p.grad = torch.ones(3, device="cuda")
    return p


def _meta_param() -> torch.Tensor:
    p = torch.nn.Parameter(torch.zeros(3, device="meta"))
    p.grad = torch.zeros(3, device="meta")
    return p


CLIP = "shardscale.clip:unscale_and_clip_"
CLI = "shardscale.cli._app:main"


class CliFailed(Exception):
    """The ``shardscale`` command exited with status 2; the message is what it printed."""


def _cli(*argv: str) -> Callable[[World], object]:
    """Run ``shardscale ARGV --out <fresh dir>`` in-process; it must refuse, creating nothing."""

    def act(world: World) -> object:
        import contextlib
        import io
        import tempfile
        from pathlib import Path

        from shardscale.cli._app import main

        out = Path(tempfile.mkdtemp(prefix="shardscale-bad-cli-")) / "out"
        args = [*argv, "--out", str(out)] if argv[0] in ("demo", "bench") else list(argv)
        text = io.StringIO()
        try:
            with contextlib.redirect_stderr(text), contextlib.redirect_stdout(text):
                code: object = main(args)
        except SystemExit as exc:
            code = exc.code
        assert not out.exists(), f"shardscale {' '.join(argv)} created {out} before refusing"
        if code != 2:
            raise AssertionError(f"expected exit status 2, got {code!r}: {text.getvalue()}")
        raise CliFailed(text.getvalue())

    return act


def _clip() -> Any:
    from shardscale import clip

    return clip


def _inf_grad_param() -> torch.Tensor:
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, math.inf, 2.0])
    return p


def _good_state(**overrides: Any) -> dict[str, Any]:
    sd: dict[str, Any] = {
        "scale": 1024.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 100,
        "_growth_tracker": 7,
    }
    for k, v in overrides.items():
        if v is _DROP:
            sd.pop(k)
        else:
            sd[k] = v
    return sd


_DROP = object()


# --------------------------------------------------------------------------------------------
# the table


@dataclass(frozen=True)
class Case:
    id: str
    setup: Callable[[], World]
    act: Callable[[World], object]
    error: type[BaseException]
    problem: str
    fix: str
    requires: str | None = None  # a module that must be importable
    env: dict[str, str] = field(default_factory=dict)


def _w(stage: str = "scaled", **kwargs: Any) -> Callable[[], World]:
    return lambda: make_world(stage, **kwargs)


def _w_then(legal: Callable[[World], object], stage: str = "scaled") -> Callable[[], World]:
    """A world after some legal calls (the snapshot is taken after them)."""

    def setup() -> World:
        world = make_world(stage)
        legal(world)
        return world

    return setup


def _scaler_ctor(**kwargs: Any) -> Callable[[World], object]:
    def act(w: World) -> object:
        return ShardedGradScaler("cpu", **{"backend": "local", **kwargs})

    return act


CASES: list[Case] = [
    # -- the per-optimizer state machine ----------------------------------------------------
    Case(
        "step-closure-kwarg",
        _w(),
        lambda w: w.scaler.step(w.opt, closure=lambda: 0.0),
        RuntimeError,
        r"closure",
        r"scaler\.scale\(loss\)\.backward\(\)",
    ),
    Case(
        "step-closure-positional",
        _w(),
        lambda w: w.scaler.step(w.opt, lambda: 0.0),
        RuntimeError,
        r"closure",
        r"scaler\.step\(optimizer\)",
    ),
    Case(
        "unscale-twice",
        _w("unscaled"),
        lambda w: w.scaler.unscale_(w.opt),
        RuntimeError,
        r"already called",
        r"at most once",
    ),
    Case(
        "unscale-after-step",
        _w("stepped"),
        lambda w: w.scaler.unscale_(w.opt),
        RuntimeError,
        r"after step\(\)",
        r"update\(\)",
    ),
    Case(
        "step-after-step",
        _w("stepped"),
        lambda w: w.scaler.step(w.opt),
        RuntimeError,
        r"already called",
        r"scaler\.update\(\)",
    ),
    Case(
        "update-before-anything",
        _w("fresh"),
        lambda w: w.scaler.update(),
        AssertionError,
        r"before the scale exists",
        r"scaler\.step\(optimizer\)",
    ),
    Case(
        "update-before-step",
        _w("scaled"),
        lambda w: w.scaler.update(),
        AssertionError,
        r"no overflow checks",
        r"call scaler\.step\(optimizer\)",
    ),
    Case(
        "step-with-model-not-optimizer",
        _w(),
        lambda w: w.scaler.step(torch.nn.Linear(2, 2)),  # type: ignore[arg-type]
        TypeError,
        r"Linear",
        r"optimizer",
    ),
    # -- update(new_scale=...) ---------------------------------------------------------------
    Case(
        "new-scale-int",
        _w("stepped"),
        lambda w: w.scaler.update(new_scale=1024),  # type: ignore[arg-type]
        TypeError,
        r"int 1024",
        r"update\(new_scale=1024\.0\)",
    ),
    Case(
        "new-scale-str",
        _w("stepped"),
        lambda w: w.scaler.update(new_scale="2.0"),  # type: ignore[arg-type]
        TypeError,
        r"got str",
        r"float or a one-element tensor",
    ),
    Case(
        "new-scale-nan",
        _w("stepped"),
        lambda w: w.scaler.update(new_scale=float("nan")),
        ValueError,
        r"new_scale=nan",
        r"finite number > 0",
    ),
    Case(
        "new-scale-inf",
        _w("stepped"),
        lambda w: w.scaler.update(new_scale=float("inf")),
        ValueError,
        r"new_scale=inf",
        r"finite number > 0",
    ),
    Case(
        "new-scale-negative",
        _w("stepped"),
        lambda w: w.scaler.update(new_scale=-8.0),
        ValueError,
        r"new_scale=-8\.0",
        r"finite number > 0",
    ),
    Case(
        "new-scale-zero",
        _w("stepped"),
        lambda w: w.scaler.update(new_scale=0.0),
        ValueError,
        r"new_scale=0\.0",
        r"finite number > 0",
    ),
    Case(
        "new-scale-tensor-two-elements",
        _w("stepped"),
        lambda w: w.scaler.update(new_scale=torch.tensor([1.0, 2.0])),
        AssertionError,
        r"2 elements",
        r"one-element float tensor",
    ),
    Case(
        "new-scale-tensor-requires-grad",
        _w("stepped"),
        lambda w: w.scaler.update(new_scale=torch.tensor(4.0, requires_grad=True)),
        AssertionError,
        r"requires grad",
        r"without grad",
    ),
    Case(
        "new-scale-tensor-int",
        _w("stepped"),
        lambda w: w.scaler.update(new_scale=torch.tensor(4, dtype=torch.int32)),
        AssertionError,
        r"torch\.int32",
        r"float tensor",
    ),
    Case(
        "new-scale-tensor-nan",
        _w("stepped"),
        lambda w: w.scaler.update(new_scale=torch.tensor(float("nan"))),
        AssertionError,
        r"nan is not a finite positive",
        r"one-element float tensor",
    ),
    Case(
        "new-scale-tensor-wrong-device",
        _w("stepped"),
        lambda w: w.scaler.update(new_scale=torch.tensor(4.0, device="meta")),
        AssertionError,
        r"on meta",
        r"on cpu",
    ),
    # -- gradients the scaler cannot handle ---------------------------------------------------
    Case(
        "integer-params",
        _w(extra_params=[_int_param()]),
        lambda w: w.scaler.step(w.opt),
        TypeError,
        r"torch\.int64",
        r"float16/bfloat16/float32/float64",
    ),
    Case(
        "complex-params",
        _w(extra_params=[_complex_param()]),
        lambda w: w.scaler.unscale_(w.opt),
        TypeError,
        r"torch\.complex64",
        r"float16/bfloat16/float32/float64",
    ),
    Case(
        "grads-on-a-device-the-scaler-was-not-built-for",
        _w(extra_params=[_meta_param()]),
        lambda w: w.scaler.step(w.opt),
        ValueError,
        r"meta",
        r"device='meta'|move",
    ),
    Case(
        "grads-on-cuda-for-a-cpu-scale",
        lambda: make_world(extra_params=[_cuda_param()]),
        lambda w: w.scaler.step(w.opt),
        ValueError,
        r"a gradient is on cuda",
        r"device='cuda'",
        requires="torch+cuda",
    ),
    Case(
        "param-no-adapter-claims",
        _w(extra_params=[_unclaimed_param()]),
        lambda w: w.scaler.step(w.opt),
        PluginNotFoundError,
        r"no grad adapter claims a parameter of type _Unclaimed",
        r"pip install shardscale-fsdp",
    ),
    Case(
        "unknown-kernels-name",
        _w(scaler_kwargs={"kernels": "warp-drive"}),
        lambda w: w.scaler.step(w.opt),
        PluginNotFoundError,
        r"warp-drive",
        r"misspelled or not installed.*foreach",
    ),
    # -- the state dict ------------------------------------------------------------------------
    Case(
        "state-dict-missing-key",
        _w("updated"),
        lambda w: w.scaler.load_state_dict(_good_state(_growth_tracker=_DROP)),
        AssertionError,
        r"missing key\(s\) \['_growth_tracker'\]",
        r"scaler\.state_dict\(\)",
    ),
    Case(
        "state-dict-truncated",
        _w("updated"),
        lambda w: w.scaler.load_state_dict({"scale": 1024.0}),
        AssertionError,
        r"missing key\(s\) \['growth_factor', 'backoff_factor'",
        r"it needs",
    ),
    Case(
        "state-dict-not-a-dict",
        _w("updated"),
        lambda w: w.scaler.load_state_dict([("scale", 2.0)]),  # type: ignore[arg-type]
        TypeError,
        r"got list",
        r"takes a dict",
    ),
    Case(
        "state-dict-empty",
        _w("updated"),
        lambda w: w.scaler.load_state_dict({}),
        RuntimeError,
        r"empty",
        r"fresh scaler",
    ),
    Case(
        "state-dict-scale-wrong-type",
        _w("updated"),
        lambda w: w.scaler.load_state_dict(_good_state(scale="1024")),
        ValueError,
        r"'scale'.*'1024'",
        r"finite float > 0",
    ),
    Case(
        "state-dict-scale-tensor",
        _w("updated"),
        lambda w: w.scaler.load_state_dict(_good_state(scale=torch.tensor(1024.0))),
        ValueError,
        r"'scale'.*tensor",
        r"finite float > 0",
    ),
    Case(
        "state-dict-negative-scale",
        _w("updated"),
        lambda w: w.scaler.load_state_dict(_good_state(scale=-1.0)),
        ValueError,
        r"'scale'.*-1\.0",
        r"finite float > 0",
    ),
    Case(
        "state-dict-nan-scale",
        _w("updated"),
        lambda w: w.scaler.load_state_dict(_good_state(scale=float("nan"))),
        ValueError,
        r"'scale'.*nan",
        r"finite float > 0",
    ),
    Case(
        "state-dict-growth-tracker-negative",
        _w("updated"),
        lambda w: w.scaler.load_state_dict(_good_state(_growth_tracker=-3)),
        ValueError,
        r"'_growth_tracker'.*-3",
        r"int >= 0",
    ),
    Case(
        "state-dict-growth-tracker-float",
        _w("updated"),
        lambda w: w.scaler.load_state_dict(_good_state(_growth_tracker=1.5)),
        ValueError,
        r"'_growth_tracker'.*1\.5",
        r"int >= 0",
    ),
    Case(
        "state-dict-growth-factor-below-one",
        _w("updated"),
        lambda w: w.scaler.load_state_dict(_good_state(growth_factor=0.5)),
        ValueError,
        r"growth_factor.*0\.5",
        r"> 1\.0",
    ),
    Case(
        "state-dict-backoff-factor-above-one",
        _w("updated"),
        lambda w: w.scaler.load_state_dict(_good_state(backoff_factor=2.0)),
        ValueError,
        r"backoff_factor.*2\.0",
        r"\(0, 1\)",
    ),
    Case(
        "state-dict-growth-interval-zero",
        _w("updated"),
        lambda w: w.scaler.load_state_dict(_good_state(growth_interval=0)),
        ValueError,
        r"growth_interval.*got 0",
        r"int >= 1",
    ),
    Case(
        "state-dict-min-above-max",
        _w("updated", scaler_kwargs={"loss_scaling": ScaleBounds(max_scale=4096.0)}),
        lambda w: w.scaler.load_state_dict(_good_state(min_scale=8192.0)),
        ValueError,
        r"min_scale \(8192\.0\).*max_scale \(4096\.0\)",
        r"must not exceed",
    ),
    Case(
        "state-dict-hysteresis-zero",
        _w("updated"),
        lambda w: w.scaler.load_state_dict(_good_state(hysteresis=0)),
        ValueError,
        r"'hysteresis'.*got 0",
        r"int >= 1",
    ),
    # -- constructor and setters ---------------------------------------------------------------
    Case(
        "ctor-growth-factor",
        _w("updated"),
        _scaler_ctor(growth_factor=1.0),
        ValueError,
        r"growth_factor.*1\.0",
        r"default is 2\.0",
    ),
    Case(
        "ctor-backoff-factor",
        _w("updated"),
        _scaler_ctor(backoff_factor=0.0),
        ValueError,
        r"backoff_factor.*0\.0",
        r"default is 0\.5",
    ),
    Case(
        "ctor-growth-interval",
        _w("updated"),
        _scaler_ctor(growth_interval=2.5),
        ValueError,
        r"growth_interval.*2\.5",
        r"default is 2000",
    ),
    Case(
        "ctor-init-scale-nan",
        _w("updated"),
        _scaler_ctor(init_scale=float("nan")),
        ValueError,
        r"init_scale.*nan",
        r"finite number > 0",
    ),
    Case(
        "ctor-hysteresis",
        _w("updated"),
        lambda w: ScaleBounds(hysteresis=0),
        ValueError,
        r"hysteresis.*got 0",
        r"int >= 1",
    ),
    Case(
        "ctor-min-above-max",
        _w("updated"),
        lambda w: ScaleBounds(min_scale=8.0, max_scale=4.0),
        ValueError,
        r"min_scale \(8\.0\)",
        r"must not exceed max_scale",
    ),
    Case(
        "ctor-distinct-dims-string",
        _w("updated"),
        lambda w: Layout(distinct_dims="pp"),  # type: ignore[arg-type]
        TypeError,
        r"distinct_dims.*'pp'",
        r"\('pp',\)",
    ),
    Case(
        "ctor-distinct-params-one-tensor",
        _w("updated"),
        lambda w: Layout(distinct_params=w.params[0]),  # type: ignore[arg-type]
        TypeError,
        r"distinct_params takes an iterable",
        r"wrap a single parameter in a list",
    ),
    Case(
        "ctor-distinct-params-not-tensors",
        _w("updated"),
        lambda w: Layout(distinct_params=["w1"]),  # type: ignore[arg-type]
        TypeError,
        r"distinct_params takes parameters",
        r"list\(module\.parameters\(\)\)",
    ),
    # The keywords that moved into option objects (issue 27): each names its replacement.
    *(
        Case(
            f"ctor-moved-{name}",
            _w("updated"),
            _scaler_ctor(**{name: value}),
            TypeError,
            problem,
            fix,
        )
        for name, value, problem, fix in [
            ("hysteresis", 2, r"hysteresis= moved", r"loss_scaling=ScaleBounds\(hysteresis=2\)"),
            ("min_scale", 8.0, r"min_scale= moved", r"loss_scaling=ScaleBounds\(min_scale=8\.0\)"),
            ("max_scale", 8.0, r"max_scale= moved", r"loss_scaling=ScaleBounds\(max_scale=8\.0\)"),
            (
                "distinct_dims",
                ("pp",),
                r"distinct_dims= moved",
                r"layout=Layout\(distinct_dims=\('pp',\)\)",
            ),
            ("distinct_params", [], r"distinct_params= moved", r"layout=Layout\(distinct_params="),
            ("spike", SpikeSkip(z=3.0), r"spike= moved", r"policies=\[SpikeSkip\(.*z=3\.0"),
            ("check_loss", True, r"check_loss= moved", r"policies=\[LossCheck\(\)\]"),
            (
                "max_consecutive_skips",
                5,
                r"max_consecutive_skips= moved",
                r"policies=\[SkipStreakLimit\(max_skips=5\)\]",
            ),
            ("registry", None, r"registry= was removed", r"get_registry\(\)\.register\("),
        ]
    ),
    Case(
        "ctor-policies-duplicate-kind",
        _w("updated"),
        _scaler_ctor(policies=[SpikeSkip(), SpikeSkip(z=3.0)]),
        ValueError,
        r"two SpikeSkip policies",
        r"at most one of each kind",
    ),
    Case(
        "ctor-policies-one-object",
        _w("updated"),
        _scaler_ctor(policies=LossCheck()),
        TypeError,
        r"got a single LossCheck",
        r"policies=\[LossCheck\(\)\]",
    ),
    Case(
        "ctor-policies-not-a-policy",
        _w("updated"),
        _scaler_ctor(policies=[True]),
        TypeError,
        r"policies holds a bool",
        r"SpikeSkip\(\.\.\.\), LossCheck\(\), SkipStreakLimit",
    ),
    Case(
        "ctor-layout-not-a-layout",
        _w("updated"),
        _scaler_ctor(layout=("pp",)),
        TypeError,
        r"layout takes a Layout",
        r"Layout\(distinct_dims=",
    ),
    Case(
        "ctor-loss-scaling-not-an-option",
        _w("updated"),
        _scaler_ctor(loss_scaling="fp16"),
        TypeError,
        r"loss_scaling must be.*'fp16'",
        r"ScaleBounds\(",
    ),
    Case(
        "streak-limit-zero",
        _w("updated"),
        lambda w: SkipStreakLimit(max_skips=0),
        ValueError,
        r"max_skips=0",
        r"\[1, 1000000\].*leave SkipStreakLimit out",
    ),
    Case(
        "spike-warmup-unbounded",
        _w("updated"),
        lambda w: SpikeSkip(warmup=10**7),
        ValueError,
        r"warmup=10000000",
        r"\[2, 65536\]",
    ),
    Case(
        "spike-window-unbounded",
        _w("updated"),
        lambda w: SpikeSkip(window=2**17),
        ValueError,
        r"window=131072",
        r"\[2, 65536\]",
    ),
    Case(
        "ctor-backend-not-a-backend",
        _w("updated"),
        _scaler_ctor(backend=42),
        TypeError,
        r"backend.*int",
        r"'c10d'|CollectiveBackend",
    ),
    Case(
        "set-growth-factor",
        _w("updated"),
        lambda w: w.scaler.set_growth_factor(0.9),
        ValueError,
        r"growth_factor.*0\.9",
        r"> 1\.0",
    ),
    Case(
        "set-backoff-factor",
        _w("updated"),
        lambda w: w.scaler.set_backoff_factor(float("nan")),
        ValueError,
        r"backoff_factor.*nan",
        r"\(0, 1\)",
    ),
    Case(
        "set-growth-interval",
        _w("updated"),
        lambda w: w.scaler.set_growth_interval(-1),
        ValueError,
        r"growth_interval.*-1",
        r"int >= 1",
    ),
    Case(
        "scale-not-a-tensor",
        _w("updated"),
        lambda w: w.scaler.scale(3.0),  # type: ignore[call-overload]
        TypeError,
        r"got float",
        r"a tensor or an iterable of tensors",
    ),
    # -- the registry and backend selection -----------------------------------------------------
    Case(
        "unknown-backend-name",
        _w(),
        _scaler_ctor(backend="carrier-pigeon"),
        PluginNotFoundError,
        r"no backend named 'carrier-pigeon'",
        r"misspelled or not installed.*Installed backends: .*local",
    ),
    Case(
        "shardscale-backend-env-not-installed",
        _w(scaler_kwargs={"backend": None}),
        lambda w: w.scaler.step(w.opt),
        PluginNotFoundError,
        r"no backend named 'carrier-pigeon'.*\$SHARDSCALE_BACKEND",
        r"misspelled or not installed.*Installed backends",
        env={"SHARDSCALE_BACKEND": "carrier-pigeon"},
    ),
    Case(
        "backend-spec-empty-name",
        _w(),
        _scaler_ctor(backend="local+"),
        ShardscaleError,
        r"empty name",
        # An example chain of what is installed here; core names no other distribution's items.
        r"middleware first and a backend last, e\.g\. '[\w<>-]+\+[\w<>-]+'",
    ),
    Case(
        "middleware-chain-ends-in-middleware",
        _with_plugins((_TapPlugin(), "tap-plugin")),
        _scaler_ctor(backend="tap"),
        ShardscaleError,
        r"ends in the middleware 'tap'",
        r"must end in a backend, e.g. 'tap\+",
    ),
    Case(
        "backend-used-as-middleware",
        _w(),
        _scaler_ctor(backend="local+local"),
        ShardscaleError,
        r"'local' is a backend, not a middleware",
        r"only the last name",
    ),
    Case(
        "unknown-middleware",
        _with_plugins((_TapPlugin(), "tap-plugin")),
        _scaler_ctor(backend="tapp+local"),
        PluginNotFoundError,
        r"no middleware named 'tapp'",
        r"misspelled or not installed.*tap",
    ),
    Case(
        "two-plugins-claim-one-backend-name",
        _with_plugins((_DupPlugin(), "dup-one"), (_DupPlugin(), "dup-two")),
        _scaler_ctor(backend="dup"),
        PluginConflictError,
        r"'dup' is claimed by .*dup-one.* and .*dup-two",
        r"'<distribution>:dup'",
    ),
    Case(
        "register-a-name-twice",
        _with_plugins((_TapPlugin(), "tap-plugin")),
        lambda w: w.registry.register(_TapPlugin(), name="tap-plugin"),
        PluginConflictError,
        r"'tap-plugin' is already registered",
        r"another name=",
    ),
    Case(
        "unregister-unknown",
        _w(),
        lambda w: w.registry.unregister("never-registered"),
        PluginNotFoundError,
        r"never-registered",
        r"no registered plugin",
    ),
    Case(
        "plugin-item-without-name",
        _w(),
        lambda w: _while_registered(
            w, _NamelessPlugin(), "nameless", _scaler_ctor(backend="local")
        ),
        ShardscaleError,
        r"plugin 'nameless' returned a backend without a string 'name'",
        r"'name' attribute",
    ),
    Case(
        "unknown-kernels-lookup",
        _w(),
        lambda w: w.registry.kernels_for(torch.device("cpu"), "warp-drive"),
        PluginNotFoundError,
        r"no kernels named 'warp-drive'",
        r"Installed kernelss?: .*foreach",
    ),
    # -- the step contract at core's own entries (issue 18, item 1) ----------------------------
    Case(
        "unscale-max-norm-negative",
        _w(),
        lambda w: w.scaler.unscale_(w.opt, max_norm=-1.0),
        ValueError,
        r"max_norm .*got -1\.0",
        r"positive number",
    ),
    Case(
        "unscale-max-norm-nan",
        _w(),
        lambda w: w.scaler.unscale_(w.opt, max_norm=float("nan")),
        ValueError,
        r"max_norm .*got nan",
        r"positive number",
    ),
    Case(
        "unscale-max-norm-bool",
        _w(),
        lambda w: w.scaler.unscale_(w.opt, max_norm=True),
        TypeError,
        r"the bool True",
        r"must be a number",
    ),
    Case(
        "unscale-norm-type-zero",
        _w(),
        lambda w: w.scaler.unscale_(w.opt, max_norm=1.0, norm_type=0),
        ValueError,
        r"norm_type .*got 0",
        r"> 0 \(e\.g\. 1\.0, 2\.0\) or float\('inf'\)",
    ),
    Case(
        "unscale-max-norm-negative-disabled",
        _w(scaler_kwargs={"enabled": False}),
        lambda w: w.scaler.unscale_(w.opt, max_norm=-1.0),
        ValueError,
        r"max_norm .*got -1\.0",
        r"positive number",
    ),
    Case(
        "unscale-unknown-kernels",
        _w(),
        lambda w: w.scaler.unscale_(w.opt, kernels="warp-drive"),
        PluginNotFoundError,
        r"no kernels named 'warp-drive'",
        r"Installed kernelss?: .*foreach",
    ),
    Case(
        "scaler-clip-max-norm-negative",
        _w("unscaled"),
        lambda w: w.scaler.clip_grad_norm_(w.params, -1.0),
        ValueError,
        r"max_norm .*got -1\.0",
        r"positive number",
    ),
    Case(
        "scaler-clip-norm-type-negative",
        _w("unscaled"),
        lambda w: w.scaler.clip_grad_norm_(w.params, 1.0, norm_type=-2.0),
        ValueError,
        r"norm_type .*got -2\.0",
        r"> 0 \(e\.g\. 1\.0, 2\.0\)",
    ),
    Case(
        "scaler-clip-error-if-nonfinite-string",
        _w("unscaled"),
        lambda w: w.scaler.clip_grad_norm_(w.params, 1.0, error_if_nonfinite="no"),
        TypeError,
        r"error_if_nonfinite .*got str 'no'",
        r"True or False",
    ),
    Case(
        "scaler-clip-foreach-string",
        _w("unscaled"),
        lambda w: w.scaler.clip_grad_norm_(w.params, 1.0, foreach="yes"),
        TypeError,
        r"foreach .*got 'yes'",
        r"True, False or None",
    ),
    Case(
        "scaler-clip-nonfinite",
        _w("unscaled", extra_params=[_inf_grad_param()]),
        lambda w: w.scaler.clip_grad_norm_(w.params, 1.0, error_if_nonfinite=True),
        RuntimeError,
        r"non-finite",
        r"error_if_nonfinite=False",
    ),
    Case(
        "scaler-kernels-not-a-name",
        _w("fresh"),
        lambda w: ShardedGradScaler("cpu", kernels=3),
        TypeError,
        r"kernels must be the name .*got int 3",
        r"'foreach'",
    ),
    Case(
        "scaler-distinct-dims-not-names",
        _w("fresh"),
        lambda w: ShardedGradScaler("cpu", layout=Layout(distinct_dims=("pp", 1))),
        TypeError,
        r"distinct_dims .*got int 1",
        r"mesh_dim_names",
    ),
    # -- shardscale-clip ---------------------------------------------------------------------------
    Case(
        "clip-max-norm-negative",
        _w(),
        lambda w: _clip().clip_grad_norm_(w.params, -1.0),
        ValueError,
        r"max_norm .*got -1\.0",
        r"positive number",
        requires=CLIP,
    ),
    Case(
        "clip-max-norm-zero",
        _w(),
        lambda w: _clip().clip_grad_norm_(w.params, 0.0),
        ValueError,
        r"max_norm .*got 0\.0",
        r"positive number",
        requires=CLIP,
    ),
    Case(
        "clip-max-norm-nan",
        _w(),
        lambda w: _clip().clip_grad_norm_(w.params, float("nan")),
        ValueError,
        r"max_norm .*got nan",
        r"positive number",
        requires=CLIP,
    ),
    Case(
        "clip-max-norm-bool",
        _w(),
        lambda w: _clip().clip_grad_norm_(w.params, True),
        TypeError,
        r"the bool True",
        r"must be a number",
        requires=CLIP,
    ),
    Case(
        "clip-norm-type-zero",
        _w(),
        lambda w: _clip().clip_grad_norm_(w.params, 1.0, norm_type=0),
        ValueError,
        r"norm_type .*got 0",
        r"> 0 \(e\.g\. 1\.0, 2\.0\) or float\('inf'\)",
        requires=CLIP,
    ),
    Case(
        "clip-norm-type-negative",
        _w(),
        lambda w: _clip().get_total_norm([p.grad for p in w.params], norm_type=-2.0),
        ValueError,
        r"norm_type .*got -2\.0",
        r"> 0 \(e\.g\. 1\.0, 2\.0\)",
        requires=CLIP,
    ),
    Case(
        "clip-norm-type-string",
        _w(),
        lambda w: _clip().clip_grad_norm_(w.params, 1.0, norm_type="fro"),
        TypeError,
        r"got str 'fro'",
        r"must be a number \(or 'inf'\)",
        requires=CLIP,
    ),
    Case(
        "clip-integer-params",
        _w(extra_params=[_int_param()]),
        lambda w: _clip().clip_grad_norm_(w.params, 1.0),
        TypeError,
        r"torch\.int64",
        r"float16/bfloat16/float32/float64",
        requires=CLIP,
    ),
    Case(
        "clip-error-if-nonfinite",
        _w(extra_params=[_inf_grad_param()]),
        lambda w: _clip().clip_grad_norm_(w.params, 1.0, error_if_nonfinite=True),
        RuntimeError,
        r"non-finite",
        r"error_if_nonfinite=False|unscale_and_clip_",
        requires=CLIP,
    ),
    Case(
        "clip-unknown-backend",
        _w(),
        lambda w: _clip().clip_grad_norm_(w.params, 1.0, backend="carrier-pigeon"),
        PluginNotFoundError,
        r"no backend named 'carrier-pigeon'",
        r"misspelled or not installed",
        requires=CLIP,
    ),
    Case(
        "unscale-and-clip-twice",
        _w_then(lambda w: _clip().unscale_and_clip_(w.scaler, w.opt, 1.0)),
        lambda w: _clip().unscale_and_clip_(w.scaler, w.opt, 1.0),
        RuntimeError,
        r"already unscaled",
        r"once per optimizer",
        requires=CLIP,
    ),
    Case(
        "unscale-and-clip-after-unscale",
        _w("unscaled"),
        lambda w: _clip().unscale_and_clip_(w.scaler, w.opt, 1.0),
        RuntimeError,
        r"already unscaled",
        r"before scaler\.step\(optimizer\)",
        requires=CLIP,
    ),
    Case(
        "unscale-and-clip-torch-scaler",
        _w(),
        lambda w: _clip().unscale_and_clip_(torch.amp.GradScaler("cpu"), w.opt, 1.0),
        TypeError,
        r"got GradScaler",
        r"ShardedGradScaler\(\.\.\.\) with the same arguments",
        requires=CLIP,
    ),
    Case(
        "unscale-and-clip-bad-max-norm",
        _w(),
        lambda w: _clip().unscale_and_clip_(w.scaler, w.opt, -3.0),
        ValueError,
        r"max_norm .*got -3\.0",
        r"positive number",
        requires=CLIP,
    ),
    Case(
        "unscale-and-clip-bad-norm-type",
        _w(),
        lambda w: _clip().unscale_and_clip_(w.scaler, w.opt, 1.0, norm_type=float("nan")),
        ValueError,
        r"norm_type .*got nan",
        r"> 0",
        requires=CLIP,
    ),
    # -- the shardscale command -------------------------------------------------------------------
    Case(
        "cli-unknown-command",
        _w(),
        _cli("frobnicate"),
        CliFailed,
        r"invalid choice: 'frobnicate'",
        r"choose from 'demo'",
        requires=CLI,
    ),
    Case(
        "cli-demo-world-size-zero",
        _w(),
        _cli("demo", "--world-size", "0"),
        CliFailed,
        r"--world-size .*got 0",
        r"must be >= 1",
        requires=CLI,
    ),
    Case(
        "cli-demo-bad-mesh",
        _w(),
        _cli("demo", "--mesh", "3x"),
        CliFailed,
        r"--mesh '3x': a dimension is missing",
        r"e\.g\. 'dp4', 'dp2xtp2'",
        requires=CLI,
    ),
    Case(
        "cli-demo-mesh-vs-world-size",
        _w(),
        _cli("demo", "--mesh", "2x2", "--world-size", "2"),
        CliFailed,
        r"needs 4 processes but the world size is 2",
        r"--world-size 4",
        requires=CLI,
    ),
    Case(
        "cli-demo-precision",
        _w(),
        _cli("demo", "--precision", "fp8"),
        CliFailed,
        r"invalid choice: 'fp8'",
        r"choose from 'fp16', 'bf16'",
        requires=CLI,
    ),
    Case(
        "cli-demo-steps-zero",
        _w(),
        _cli("demo", "--steps", "0"),
        CliFailed,
        r"steps .*got 0",
        r"must be >= 1",
        requires=CLI,
    ),
    Case(
        "cli-demo-max-norm-negative",
        _w(),
        _cli("demo", "--max-norm", "-1"),
        CliFailed,
        r"--max-norm: max_norm must be a positive number .*got -1\.0",
        r"try e\.g\. --max-norm 1\.0",
        requires=CLI,
    ),
    Case(
        "cli-demo-unknown-backend",
        _w(),
        _cli("demo", "--backend", "carrier-pigeon"),
        CliFailed,
        r"no backend named 'carrier-pigeon'",
        r"shardscale plugins",
        requires=CLI,
    ),
    Case(
        "cli-demo-cuda-without-gpus",
        _w(),
        _cli("demo", "--device", "cuda"),
        CliFailed,
        r"needs 2 GPUs; this machine has 0",
        r"--device cpu",
        requires=CLI + "+nocuda",
    ),
    # -- shardscale-collectives -------------------------------------------------------------------
    Case(
        "nccl-without-cuda",
        _w(),
        _scaler_ctor(backend="nccl"),
        BackendUnavailableError,
        r"'nccl' cannot run here: CUDA is not available",
        r"Choose a backend that can, e\.g\. one of: .*gloo",
        # The no-CUDA error path: on a machine with CUDA nccl is usable and nothing fails.
        requires="shardscale.collectives+nocuda",
    ),
    Case(
        "counting-alone",
        _w(),
        _scaler_ctor(backend="counting"),
        ShardscaleError,
        r"ends in the middleware 'counting'",
        r"'counting\+c10d'",
        requires="shardscale.collectives",
    ),
]


def _module_has(module: str, attr: str | None = None) -> bool:
    if importlib.util.find_spec(module.split(".", maxsplit=1)[0]) is None:
        return False
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return False
    if spec is None:
        return False
    if attr is None:
        return True
    mod = importlib.import_module(module)
    return hasattr(mod, attr)


def _requirement_met(case: Case) -> bool:
    if case.requires is None:
        return True
    requires, _, flag = case.requires.partition("+")
    if flag == "nocuda" and torch.cuda.is_available():
        return False
    if flag == "cuda" and not torch.cuda.is_available():
        return False
    module, _, attr = requires.partition(":")
    if not _module_has(module, attr or None):
        return False
    if module == "shardscale.collectives":
        # The collectives package exists from the scaffold on; its backends arrive later.
        return "nccl" in Registry().names("backend")
    return True


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c.id, marks=[pytest.mark.gpu] if "+cuda" in (c.requires or "") else [])
        for c in CASES
    ],
)
def test_bad_input(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    if not _requirement_met(case):
        pytest.skip(f"needs {case.requires}, not available here")
    monkeypatch.delenv("SHARDSCALE_BACKEND", raising=False)
    monkeypatch.delenv("SHARDSCALE_DISABLE_PLUGINS", raising=False)
    world = case.setup()
    before = snapshot(world)
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(case.error) as info:
        case.act(world)
    message = str(info.value)
    assert re.search(case.problem, message, re.I | re.S), (
        f"the message does not name the problem ({case.problem!r}): {message}"
    )
    assert re.search(case.fix, message, re.I | re.S), (
        f"the message does not say how to fix it ({case.fix!r}): {message}"
    )
    for key in case.env:
        monkeypatch.delenv(key)
    assert_same(before, snapshot(world))


def test_the_table_is_big_enough() -> None:
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)


def test_a_failed_call_leaves_the_iteration_usable() -> None:
    """After a rejected call the same iteration completes exactly as if it never happened."""
    clean = make_world("scaled")
    clean.scaler.step(clean.opt)
    clean.scaler.update()

    bumpy = make_world("scaled")
    for bad in (
        lambda: bumpy.scaler.step(bumpy.opt, closure=lambda: 0.0),
        lambda: bumpy.scaler.update(new_scale=float("nan")),
        lambda: bumpy.scaler.load_state_dict(_good_state(scale=-1.0)),
        bumpy.scaler.update,
    ):
        with pytest.raises((RuntimeError, ValueError, TypeError, AssertionError)):
            bad()
    bumpy.scaler.step(bumpy.opt)
    bumpy.scaler.update()
    assert_same(snapshot(clean), snapshot(bumpy))


def test_layout_error_is_a_value_error() -> None:
    # LayoutError is what the scaler raises for parameters over groups it cannot combine
    # (exercised with real process groups in integration_tests/test_faults.py).
    assert issubclass(LayoutError, ValueError) and issubclass(LayoutError, ShardscaleError)
    assert issubclass(ScalerStateError, AssertionError)
