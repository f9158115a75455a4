"""The plugin registry: entry-point discovery, blocking, lookups, composition, listing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from shardscale.core import (
    Handle,
    LocalBackend,
    PluginConflictError,
    PluginNotFoundError,
    PluginWarning,
    ReduceOp,
    Registry,
    ShardscaleError,
    hookimpl,
)
from shardscale.core.plugins import BACKEND_ENV, DISABLE_ENV, CompletedHandle


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    return Registry()


class EchoBackend(LocalBackend):
    name: ClassVar[str] = "echo"


class Tagging:
    """A middleware that records the ops it forwards."""

    name: ClassVar[str] = "tagging"

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ops: list[ReduceOp] = []

    def all_reduce(self, tensor: torch.Tensor, *, op: ReduceOp, group: Any) -> Handle:
        self.ops.append(op)
        return self.inner.all_reduce(tensor, op=op, group=group)  # type: ignore[no-any-return]

    def world_size(self, group: Any) -> int:
        return self.inner.world_size(group)  # type: ignore[no-any-return]

    def rank(self, group: Any) -> int:
        return self.inner.rank(group)  # type: ignore[no-any-return]

    def group_ranks(self, group: Any) -> tuple[int, ...]:
        return self.inner.group_ranks(group)  # type: ignore[no-any-return]


class ExtraPlugin:
    @hookimpl
    def shardscale_collective_backends(self) -> list[type]:
        return [EchoBackend]

    @hookimpl
    def shardscale_middlewares(self) -> list[type]:
        return [Tagging]


@pytest.fixture
def with_extra(registry: Registry) -> Iterator[Registry]:
    name = registry.register(ExtraPlugin(), name="extra")
    try:
        yield registry
    finally:
        registry.unregister(name)


def test_core_plugin_comes_from_its_entry_point(registry: Registry) -> None:
    plugins = {p.name: p for p in registry.plugins()}
    assert plugins["core"].distribution == "shardscale-core"
    assert plugins["core"].version
    assert "shardscale_collective_backends" in plugins["core"].hooks


def test_loading_is_lazy_and_happens_once(registry: Registry) -> None:
    assert registry._loaded is False
    registry.names("backend")
    assert registry._loaded is True
    before = [p.name for p in registry.plugins()]
    registry.load()
    assert [p.name for p in registry.plugins()] == before


def test_builtins_are_listed_with_kind_distribution_and_version(registry: Registry) -> None:
    items = {(i.kind, i.name): i for i in registry.items()}
    for key in [("backend", "local"), ("adapter", "plain"), ("kernels", "foreach")]:
        assert key in items, key
        assert items[key].distribution == "shardscale-core"
        assert items[key].usable and items[key].reason is None


def test_disable_env_blocks_a_plugin_before_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, " core ,something-else")
    registry = Registry()
    with pytest.warns(PluginWarning, match=r"'something-else', which match no installed"):
        assert "local" not in registry.names("backend")
    assert registry.unmatched_disable_names() == ["something-else"]
    blocked = {f.name: f for f in registry.failures()}
    assert blocked["core"].blocked and blocked["core"].distribution == "shardscale-core"


def test_unknown_backend_lists_what_is_installed(registry: Registry) -> None:
    with pytest.raises(PluginNotFoundError, match=r"no backend named 'nope'.*local") as info:
        registry.make_backend("nope")
    assert "misspelled or not installed" in str(info.value)


def test_env_selects_the_backend(with_extra: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "echo")
    assert isinstance(with_extra.make_backend(), EchoBackend)
    # an explicit argument wins over the environment
    assert type(with_extra.make_backend("local")) is LocalBackend


def test_automatic_choice_without_a_process_group_is_local(registry: Registry) -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert type(registry.make_backend()) is LocalBackend


def test_middleware_composes_left_to_right(with_extra: Registry) -> None:
    backend = with_extra.make_backend("tagging+tagging+echo")
    assert isinstance(backend, Tagging) and isinstance(backend.inner, Tagging)
    assert isinstance(backend.inner.inner, EchoBackend)
    t = torch.ones(2)
    handle = backend.all_reduce(t, op=ReduceOp.MAX, group=None)
    handle.wait()
    assert backend.ops == backend.inner.ops == [ReduceOp.MAX]
    assert isinstance(handle, CompletedHandle)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tagging", "ends in the middleware 'tagging'"),
        ("echo+local", "'echo' is a backend, not a middleware"),
        ("tagging++local", "empty name"),
        ("", "empty name"),
        ("missing+local", "no middleware named 'missing'"),
    ],
)
def test_bad_chains_say_what_to_write(with_extra: Registry, spec: str, message: str) -> None:
    with pytest.raises(ShardscaleError, match=message):
        with_extra.make_backend(spec)


def test_in_process_plugins_register_and_unregister(registry: Registry) -> None:
    name = registry.register(ExtraPlugin(), name="extra")
    try:
        assert "echo" in registry.names("backend")
        item = next(i for i in registry.items() if i.name == "echo")
        assert item.plugin == "extra" and item.distribution == "<in-process>"
    finally:
        registry.unregister(name)
    assert "echo" not in registry.names("backend")
    with pytest.raises(PluginNotFoundError):
        registry.unregister("extra")


def test_duplicate_names_are_an_error_unless_qualified(registry: Registry) -> None:
    class Shadow:
        @hookimpl
        def shardscale_collective_backends(self) -> list[type]:
            class LocalAgain(LocalBackend):
                name: ClassVar[str] = "local"

            return [LocalAgain]

    name = registry.register(Shadow(), name="shadow")
    try:
        with pytest.raises(
            PluginConflictError,
            match=r"shardscale-core.*<in-process>|<in-process>.*shardscale-core",
        ):
            registry.make_backend("local")
        assert type(registry.make_backend("shardscale-core:local")) is LocalBackend
        assert type(registry.make_backend("shadow:local")) is not LocalBackend
    finally:
        registry.unregister(name)


def test_registering_the_same_name_twice_is_refused(registry: Registry) -> None:
    name = registry.register(ExtraPlugin(), name="extra")
    try:
        with pytest.raises(PluginConflictError, match="already registered"):
            registry.register(ExtraPlugin(), name="extra")
    finally:
        registry.unregister(name)


def test_an_in_process_plugin_with_a_nameless_item_is_refused(registry: Registry) -> None:
    class Nameless:
        @hookimpl
        def shardscale_collective_backends(self) -> list[object]:
            return [object()]

    before = [p.name for p in registry.plugins()]
    with pytest.raises(
        ShardscaleError,
        match=r"plugin 'nameless' returned a backend without a string 'name'.*not registered",
    ):
        registry.register(Nameless(), name="nameless")
    # Refused means unchanged: not registered, nothing recorded, lookups work.
    assert [p.name for p in registry.plugins()] == before
    assert not [f for f in registry.failures() if f.name == "nameless"]
    assert "local" in registry.names("backend")


def test_adapter_and_kernel_lookup(registry: Registry) -> None:
    assert registry.adapter_for(torch.nn.Parameter(torch.ones(1))).name == "plain"
    # Other installed packages may add faster CPU kernels; foreach serves every other device.
    assert registry.kernels_for(torch.device("meta")).name == "foreach"
    best = max(
        (k for k in registry._collect().by_kind["kernels"] if k.obj.supports(torch.device("cpu"))),
        key=lambda k: k.obj.priority,
    )
    assert registry.kernels_for(torch.device("cpu")).name == best.name
    assert registry.kernels_for(torch.device("cpu"), "foreach").name == "foreach"
    with pytest.raises(PluginNotFoundError, match="no kernels named 'triton-x'"):
        registry.kernels_for(torch.device("cpu"), "triton-x")


def test_local_backend_refuses_a_real_multi_rank_group() -> None:
    backend = LocalBackend()
    assert backend.world_size(None) == 1
    assert backend.group_ranks(None) == (0,)
    t = torch.tensor([3.0])
    backend.all_reduce(t, op=ReduceOp.SUM, group=None).wait()
    assert t.item() == 3.0


class TaggedAdapter:
    """Claims parameters tagged ``_tagged`` and records what it describes."""

    name: ClassVar[str] = "tagged"
    priority: ClassVar[int] = 50

    def __init__(self) -> None:
        self.described: list[tuple[int, ...]] = []

    def claims(self, param: torch.Tensor) -> bool:
        return bool(getattr(param, "_tagged", False))

    def describe(self, param: torch.Tensor, grad: torch.Tensor, ctx: Any) -> Any:
        from shardscale.core import GradShard

        self.described.append(tuple(param.shape))
        return GradShard(local=grad, counts=True, ranks=None)


class AdapterPlugin:
    def __init__(self) -> None:
        self.adapter = TaggedAdapter()

    @hookimpl
    def shardscale_grad_adapters(self) -> list[object]:
        return [self.adapter]


def test_an_in_process_adapter_outranks_the_plain_one_for_its_params() -> None:
    from shardscale.core import ShardedGradScaler, get_registry

    plugin = AdapterPlugin()
    registry = get_registry()
    name = registry.register(plugin, name="tagged-adapter")
    try:
        tagged = torch.nn.Parameter(torch.ones(2, 3))
        tagged._tagged = True  # type: ignore[attr-defined]
        plain = torch.nn.Parameter(torch.ones(4))
        assert registry.adapter_for(tagged).name == "tagged"
        assert registry.adapter_for(plain).name == "plain"
        assert [a.name for a in registry.adapters()][:1] == ["tagged"]
        scaler = ShardedGradScaler("cpu", backend="local", init_scale=4.0)
        opt = torch.optim.SGD([tagged, plain], lr=1.0)
        scaler.scale(tagged.sum() + plain.sum()).backward()
        scaler.unscale_(opt)
        assert plugin.adapter.described == [(2, 3)]
        assert tagged.grad is not None and torch.equal(tagged.grad, torch.ones(2, 3))
    finally:
        registry.unregister(name)
    assert "tagged" not in registry.names("adapter")
