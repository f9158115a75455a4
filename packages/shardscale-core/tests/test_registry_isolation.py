"""One bad plugin cannot break the registry: in-process plugins, one process.

Installed distributions that misbehave are tested in
``integration_tests/test_plugin_isolation.py``; these cases cover the same rules
for plugins registered in-process, where a failure at registration is refused
outright and a failure during a step is recorded and set aside.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from shardscale.core import (
    ForeachKernels,
    GradShard,
    LocalBackend,
    PlainTensorAdapter,
    PluginConflictError,
    PluginWarning,
    Registry,
    ShardedGradScaler,
    ShardscaleError,
    hookimpl,
)
from shardscale.core.plugins import BACKEND_ENV, DISABLE_ENV


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    return Registry()


def _two_steps(registry: Registry) -> tuple[list[float], list[float], float]:
    """A finite step, then an inf step, through a scaler on ``registry`` (init_scale 16)."""
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler = ShardedGradScaler("cpu", backend="local", init_scale=16.0, registry=registry)
    seen = []
    for grad in (torch.full((3,), 16.0), torch.tensor([16.0, float("inf"), 16.0])):
        opt.zero_grad()
        scaler.scale(torch.ones(()))
        param.grad = grad
        scaler.step(opt)
        scaler.update()
        seen.append(param.detach().tolist())
    return seen[0], seen[1], scaler.get_scale()


# A grad of 16 at scale 16 is 1: SGD(lr=1) takes ones to zeros; the inf step is skipped and the
# scale halves (torch's default backoff factor 0.5).
_STEPPED = ([0.0] * 3, [0.0] * 3, 8.0)


class _RaisingHook:
    @hookimpl
    def shardscale_collective_backends(self) -> list[type]:
        raise RuntimeError("hook is broken")


class _BareClass:
    @hookimpl
    def shardscale_collective_backends(self) -> Any:
        return LocalBackend


class _ExitingHook:
    @hookimpl
    def shardscale_stats_kernels(self) -> list[object]:
        raise SystemExit(3)


class _Wrapper:
    @hookimpl(wrapper=True)
    def shardscale_on_step(self, record: Any) -> Any:
        return (yield)


class _HighAdapter(PlainTensorAdapter):
    name: ClassVar[str] = "high"
    priority: ClassVar[Any] = "high"


class _StringPriority:
    @hookimpl
    def shardscale_grad_adapters(self) -> list[object]:
        return [_HighAdapter()]


@pytest.mark.parametrize(
    ("plugin", "message"),
    [
        (_RaisingHook(), r"raised RuntimeError: hook is broken"),
        (_BareClass(), r"returned the class .*LocalBackend instead of a list; .*\[LocalBackend\]"),
        (_ExitingHook(), r"raised SystemExit\(3\)"),
        (
            _StringPriority(),
            r"plugin 'bad' returned an adapter whose 'priority' is not an int .*got 'high'",
        ),
        (_Wrapper(), r"shardscale_on_step\(\) is a hook wrapper"),
    ],
    ids=["raises", "bare-class", "system-exit", "string-priority", "wrapper"],
)
def test_an_in_process_plugin_whose_hook_fails_is_refused_and_changes_nothing(
    registry: Registry, plugin: object, message: str
) -> None:
    before = ([p.name for p in registry.plugins()], registry.names("backend"))
    with pytest.raises(ShardscaleError, match=message):
        registry.register(plugin, name="bad")
    assert ([p.name for p in registry.plugins()], registry.names("backend")) == before
    assert _two_steps(registry) == _STEPPED


class _RaisingClaims(PlainTensorAdapter):
    name: ClassVar[str] = "raising-claims"
    priority: ClassVar[int] = 99

    def __init__(self) -> None:
        self.calls = 0

    def claims(self, param: torch.Tensor) -> bool:
        self.calls += 1
        raise ValueError("cannot tell")


class _AdapterPlugin:
    def __init__(self, *adapters: object) -> None:
        self.adapters = list(adapters)

    @hookimpl
    def shardscale_grad_adapters(self) -> list[object]:
        return self.adapters


@pytest.fixture
def registered(registry: Registry) -> Iterator[list[str]]:
    names: list[str] = []
    try:
        yield names
    finally:
        for name in names:
            registry.unregister(name)


def test_a_claims_that_raises_is_recorded_warned_and_set_aside(
    registry: Registry, registered: list[str]
) -> None:
    adapter = _RaisingClaims()
    registered.append(registry.register(_AdapterPlugin(adapter), name="claims-plugin"))
    with pytest.warns(PluginWarning, match=r"'claims-plugin'.*claims\(\) raised ValueError"):
        assert _two_steps(registry) == _STEPPED
    assert adapter.calls == 1  # asked about the first parameter only, then never again
    failure = next(f for f in registry.failures() if f.name == "claims-plugin")
    assert failure.stage == "claims" and failure.distribution == "<in-process>"
    assert "unregister('claims-plugin')" in failure.fix
    assert "raising-claims" not in [a.name for a in registry.adapters()]


class _RaisingSupports(ForeachKernels):
    name: ClassVar[str] = "raising-supports"
    priority: ClassVar[int] = 99

    def supports(self, device: torch.device) -> bool:
        raise RuntimeError("no idea")


class _KernelsPlugin:
    def __init__(self, *kernels: object) -> None:
        self.kernels = list(kernels)

    @hookimpl
    def shardscale_stats_kernels(self) -> list[object]:
        return self.kernels


def test_a_supports_that_raises_is_set_aside(registry: Registry, registered: list[str]) -> None:
    best_before = registry.kernels_for(torch.device("cpu")).name
    registered.append(registry.register(_KernelsPlugin(_RaisingSupports()), name="supports-plugin"))
    with pytest.warns(PluginWarning, match=r"supports\(\) raised RuntimeError: no idea"):
        assert registry.kernels_for(torch.device("cpu")).name == best_before
    assert [f.stage for f in registry.failures() if f.name == "supports-plugin"] == ["supports"]
    # The listing shows it no more, and does not raise.
    assert "raising-supports" not in [i.name for i in registry.items()]


class _Observers:
    def __init__(self, *, fail: bool) -> None:
        self.fail = fail
        self.steps: list[int] = []

    @hookimpl
    def shardscale_on_step(self, record: Any) -> None:
        self.steps.append(record.step)
        if self.fail:
            raise OSError("disk full")


def test_an_observer_that_raises_is_set_aside_and_the_others_still_observe(
    registry: Registry, registered: list[str]
) -> None:
    bad, good = _Observers(fail=True), _Observers(fail=False)
    registered.append(registry.register(bad, name="bad-observer"))
    registered.append(registry.register(good, name="good-observer"))
    with pytest.warns(PluginWarning, match=r"'bad-observer'.*OSError: disk full"):
        assert _two_steps(registry) == _STEPPED
    assert bad.steps == [1] and good.steps == [1, 2]
    assert [f.stage for f in registry.failures() if f.name == "bad-observer"] == ["observer"]


class _Tagged(PlainTensorAdapter):
    priority: ClassVar[int] = 40
    tag: ClassVar[str] = ""

    def claims(self, param: torch.Tensor) -> bool:
        return bool(getattr(param, self.tag, False))

    def describe(self, param: torch.Tensor, grad: torch.Tensor, ctx: Any) -> GradShard:
        return GradShard(local=grad, counts=True)


class _TagA(_Tagged):
    name: ClassVar[str] = "tag-a"
    tag: ClassVar[str] = "_a"


class _TagB(_Tagged):
    name: ClassVar[str] = "tag-b"
    tag: ClassVar[str] = "_b"


class _TagAToo(_Tagged):
    name: ClassVar[str] = "tag-a-too"
    tag: ClassVar[str] = "_a"


def test_equal_priorities_are_harmless_apart_and_an_error_together(
    registry: Registry, registered: list[str]
) -> None:
    registered.append(registry.register(_AdapterPlugin(_TagA()), name="plugin-a"))
    registered.append(registry.register(_AdapterPlugin(_TagB()), name="plugin-b"))
    a, b, both = (torch.nn.Parameter(torch.ones(1)) for _ in range(3))
    a._a = both._a = True  # type: ignore[attr-defined]
    b._b = both._b = True  # type: ignore[attr-defined]
    assert registry.adapter_for(a).name == "tag-a"
    assert registry.adapter_for(b).name == "tag-b"
    with pytest.raises(PluginConflictError, match=r"'tag-a'.*'tag-b'.*same priority 40"):
        registry.adapter_for(both)
    # The same, whichever registered first: never settled by registration order.
    registered.append(registry.register(_AdapterPlugin(_TagAToo()), name="plugin-0"))
    with pytest.raises(PluginConflictError, match=r"'tag-a-too'.*'tag-a'|'tag-a'.*'tag-a-too'"):
        registry.adapter_for(a)


class _MetaKernels(ForeachKernels):
    priority: ClassVar[int] = 7

    def supports(self, device: torch.device) -> bool:
        return device.type == "meta"


class _MetaOne(_MetaKernels):
    name: ClassVar[str] = "meta-one"


class _MetaTwo(_MetaKernels):
    name: ClassVar[str] = "meta-two"


def test_equal_priority_kernels_for_one_device_are_an_error_unless_named(
    registry: Registry, registered: list[str]
) -> None:
    registered.append(registry.register(_KernelsPlugin(_MetaOne()), name="k1"))
    registered.append(registry.register(_KernelsPlugin(_MetaTwo()), name="k2"))
    with pytest.raises(PluginConflictError, match=r"'meta-one'.*'meta-two'.*device meta"):
        registry.kernels_for(torch.device("meta"))
    assert registry.kernels_for(torch.device("meta"), "meta-two").name == "meta-two"
    assert registry.kernels_for(torch.device("cpu")).name != "meta-one"


class _AutoBackend(LocalBackend):
    automatic_priority: ClassVar[int] = 99


class _AutoOne(_AutoBackend):
    name: ClassVar[str] = "auto-one"


class _AutoTwo(_AutoBackend):
    name: ClassVar[str] = "auto-two"


class _BackendPlugin:
    def __init__(self, *classes: type) -> None:
        self.classes = list(classes)

    @hookimpl
    def shardscale_collective_backends(self) -> list[type]:
        return self.classes


def test_the_automatic_backend_is_declared_never_named_by_core(
    registry: Registry, registered: list[str]
) -> None:
    # Without a process group: core's own 'local'. With one: the declared highest.
    assert registry.backend_spec(distributed=False) == ("core:local", "automatic choice")
    registered.append(registry.register(_BackendPlugin(_AutoOne), name="auto1"))
    assert registry.backend_spec(distributed=True) == ("auto1:auto-one", "automatic choice")
    registered.append(registry.register(_BackendPlugin(_AutoTwo), name="auto2"))
    with pytest.raises(PluginConflictError, match=r"'auto-one'.*'auto-two'.*automatic_priority 99"):
        registry.backend_spec(distributed=True)


# Item names that belong to other distributions of this repository.
_FOREIGN_ITEMS = ("c10d", "gloo", "nccl", "counting", "coalescing", "dtensor", "fsdp1")


def test_core_code_names_only_its_own_items() -> None:
    """No string that core's code acts on or prints names another distribution's item."""
    from shardscale import core

    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, _FOREIGN_ITEMS)) + r")(?![\w-])")
    offenders = []
    for path in sorted(Path(core.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and pattern.search(node.value)
            ):
                offenders.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert not offenders, "\n".join(offenders)


def test_warnings_are_plugin_warnings_and_a_healthy_registry_gives_none(
    registry: Registry,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.items()
        registry.failures()
        assert _two_steps(registry) == _STEPPED
    assert issubclass(PluginWarning, UserWarning)


def test_kernels_named_by_the_caller_whose_supports_raises_say_so(
    registry: Registry, registered: list[str]
) -> None:
    from shardscale.core import BackendUnavailableError

    registered.append(registry.register(_KernelsPlugin(_RaisingSupports()), name="named-k"))
    with (
        pytest.warns(PluginWarning),
        pytest.raises(BackendUnavailableError, match=r"'raising-supports' failed.*no idea"),
    ):
        registry.kernels_for(torch.device("cpu"), "raising-supports")
