"""The plugin registry: one pluggy plugin manager fed by the ``shardscale`` entry points.

[Note: how plugins are found]
Plugins come from exactly two places: installed distributions that list a
module in the ``shardscale`` entry-point group, and objects registered
in-process with :meth:`Registry.register`. Nothing is ever imported from a path
or a module name taken from the environment. Entry points load lazily, on the
first lookup, once per process. Names in ``SHARDSCALE_DISABLE_PLUGINS`` (entry
point or distribution names, comma separated) are blocked *before* import. A
plugin that fails to import is recorded with its distribution and error and the
others still load. The built-in plugin of ``shardscale-core`` arrives through
the same entry-point path as everybody else's.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

from shardscale.core import _hookspecs
from shardscale.core._errors import (
    BackendUnavailableError,
    PluginConflictError,
    PluginNotFoundError,
    ShardscaleError,
)

if TYPE_CHECKING:
    import torch

    from shardscale.core._protocols import (
        CollectiveBackend,
        GradAdapter,
        StatsKernels,
        StepRecord,
    )

__all__ = [
    "DISABLE_ENV",
    "BACKEND_ENV",
    "IN_PROCESS",
    "PluginInfo",
    "ItemInfo",
    "LoadFailure",
    "Registry",
    "get_registry",
    "reset_registry",
]

DISABLE_ENV = "SHARDSCALE_DISABLE_PLUGINS"
BACKEND_ENV = "SHARDSCALE_BACKEND"
#: The "distribution" reported for plugins registered in-process.
IN_PROCESS = "<in-process>"
_CORE_PLUGIN = "shardscale.core._plugin"


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """One registered plugin (a module or object) and where it came from."""

    name: str
    distribution: str
    version: str
    hooks: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ItemInfo:
    """One named thing a plugin provides: a backend, middleware, adapter or kernels."""

    name: str
    kind: str
    plugin: str
    distribution: str
    version: str
    usable: bool
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class LoadFailure:
    """A plugin that could not be imported, or was blocked by the user."""

    name: str
    distribution: str
    version: str
    error: str
    blocked: bool = False


@dataclass(slots=True)
class _Item:
    name: str
    kind: str
    obj: Any
    plugin: str


@dataclass(slots=True)
class _Catalog:
    by_kind: dict[str, list[_Item]] = field(default_factory=dict)
    # Adapters are consulted once per parameter per step: sort them once per catalog.
    adapters_by_priority: list[GradAdapter] | None = None


def _blocked_names() -> frozenset[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


def _unavailable_reason(obj: Any) -> str | None:
    probe = getattr(obj, "unavailable_reason", None)
    if probe is None:
        return None
    try:
        reason = probe()
    except Exception as exc:  # a broken probe must not break listing
        return f"availability check failed: {exc!r}"
    return None if reason is None else str(reason)


class Registry:
    """shardscale's plugin manager, with a typed lookup per kind of plugin."""

    def __init__(self, *, load_entry_points: bool = True) -> None:
        self._pm = pluggy.PluginManager(_hookspecs.PROJECT)
        self._pm.add_hookspecs(_hookspecs)
        self._load_entry_points = load_entry_points
        self._loaded = False
        self._lock = threading.RLock()
        self._origins: dict[str, tuple[str, str]] = {}
        self._failures: list[LoadFailure] = []
        self._catalog: _Catalog | None = None

    # -- loading -------------------------------------------------------------------------------

    def load(self) -> None:
        """Load installed plugins (once). Lookups call this for you."""
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            if self._load_entry_points:
                try:
                    self._load_from_entry_points()
                except PluginConflictError:
                    # Nothing was registered: the next lookup raises the same error again.
                    self._loaded = False
                    self._failures.clear()
                    raise
            # Running from a source tree without shardscale-core's metadata: the
            # built-in plugin still registers through the same hook path.
            if "core" not in self._origins and "core" not in _blocked_names():
                import importlib

                self._register(
                    importlib.import_module(_CORE_PLUGIN),
                    "core",
                    "shardscale-core",
                    _dist_version("shardscale-core"),
                )

    def _load_from_entry_points(self) -> None:
        blocked = _blocked_names()
        chosen: dict[str, md.EntryPoint] = {}
        # First pass: blocked names and conflicts, before anything is imported or registered,
        # so a conflict leaves the registry empty (and raises again on the next lookup).
        for ep in md.entry_points(group=_hookspecs.ENTRY_POINT_GROUP):
            dist_name, version = _ep_origin(ep)
            if ep.name in blocked or dist_name in blocked:
                failure = LoadFailure(
                    ep.name, dist_name, version, f"blocked by {DISABLE_ENV}", True
                )
                if failure not in self._failures:  # the same distribution twice on sys.path
                    self._failures.append(failure)
                continue
            previous = chosen.get(ep.name)
            if previous is not None:
                if previous.value == ep.value and _ep_origin(previous)[0] == dist_name:
                    continue  # the same distribution seen twice on sys.path
                raise PluginConflictError(
                    f"two installed distributions register the shardscale plugin {ep.name!r}: "
                    f"{_ep_origin(previous)[0]} ({previous.value}) and {dist_name} ({ep.value}). "
                    f"Uninstall one of them, or block one by its distribution name, e.g. "
                    f"{DISABLE_ENV}={dist_name}."
                )
            chosen[ep.name] = ep
        for ep in chosen.values():
            dist_name, version = _ep_origin(ep)
            try:
                plugin = ep.load()
            except Exception as exc:  # report it, keep loading the others
                self._failures.append(
                    LoadFailure(ep.name, dist_name, version, f"{type(exc).__name__}: {exc}")
                )
                continue
            self._register(plugin, ep.name, dist_name, version)

    def _register(self, plugin: object, name: str, dist: str, version: str) -> None:
        self._pm.register(plugin, name=name)
        self._origins[name] = (dist, version)
        self._catalog = None

    def register(self, plugin: object, *, name: str | None = None) -> str:
        """Register a plugin object in-process (tests, notebooks). Returns its name.

        Unregister it with :meth:`unregister`, typically in a ``finally`` block.
        """
        self.load()
        with self._lock:
            plugin_name = name or getattr(plugin, "__name__", None) or f"plugin-{id(plugin):x}"
            if plugin_name in self._origins:
                raise PluginConflictError(
                    f"a plugin named {plugin_name!r} is already registered (from "
                    f"{self._origins[plugin_name][0]}); pass another name=..."
                )
            self._register(plugin, plugin_name, IN_PROCESS, "")
            return plugin_name

    def unregister(self, plugin_or_name: object | str) -> None:
        """Remove a plugin registered in-process (or any plugin, by name)."""
        with self._lock:
            if isinstance(plugin_or_name, str):
                name = plugin_or_name
                plugin = self._pm.get_plugin(name)
            else:
                plugin = plugin_or_name
                name = self._pm.get_name(plugin) or ""
            if plugin is None or not name:
                raise PluginNotFoundError(f"no registered plugin {plugin_or_name!r} to unregister")
            self._pm.unregister(plugin, name=name)
            self._origins.pop(name, None)
            self._catalog = None

    # -- catalog -------------------------------------------------------------------------------

    def _collect(self) -> _Catalog:
        self.load()
        with self._lock:
            if self._catalog is not None:
                return self._catalog
            catalog = _Catalog()
            for hook_name, kind in _hookspecs.HOOK_KINDS.items():
                if kind == "observer":
                    continue
                items: list[_Item] = []
                caller = getattr(self._pm.hook, hook_name)
                for impl in caller.get_hookimpls():
                    for obj in impl.function() or ():
                        name = getattr(obj, "name", None)
                        if not isinstance(name, str) or not name:
                            raise ShardscaleError(
                                f"plugin {impl.plugin_name!r} returned a {kind} without a string "
                                f"'name' attribute from {hook_name}(): {obj!r}"
                            )
                        items.append(_Item(name, kind, obj, impl.plugin_name))
                catalog.by_kind[kind] = items
            self._catalog = catalog
            return catalog

    def _origin(self, plugin: str) -> tuple[str, str]:
        return self._origins.get(plugin, (IN_PROCESS, ""))

    def _lookup(self, kind: str, name: str) -> Any:
        items = self._collect().by_kind.get(kind, [])
        qualifier, _, bare = name.rpartition(":")
        matches = [
            it
            for it in items
            if it.name == bare
            and (not qualifier or qualifier in (it.plugin, self._origin(it.plugin)[0]))
        ]
        if not matches:
            available = sorted({it.name for it in items})
            raise PluginNotFoundError(
                f"no {kind} named {name!r}: misspelled or not installed. "
                f"Installed {kind}s: {', '.join(available) or '(none)'}."
                + _install_hint(kind, bare)
                + self._failures_hint()
            )
        if len(matches) > 1:
            owners = " and ".join(
                f"{self._origin(m.plugin)[0]} (plugin {m.plugin!r})" for m in matches
            )
            raise PluginConflictError(
                f"the {kind} name {bare!r} is claimed by {owners}. Pick one explicitly as "
                f"'<distribution>:{bare}', e.g. {self._origin(matches[0].plugin)[0]}:{bare}."
            )
        return matches[0].obj

    def _failures_hint(self) -> str:
        # The name may belong to a plugin that did not load: say so rather than "not installed".
        if not self._failures:
            return ""
        parts = [
            f"{f.name} ({f.distribution}): {'blocked' if f.blocked else f.error}"
            for f in self._failures
        ]
        return " Plugins not loaded: " + "; ".join(parts) + "."

    # -- typed lookups -------------------------------------------------------------------------

    def backend_class(self, name: str) -> type[CollectiveBackend]:
        """The collective backend class registered as ``name``."""
        cls: type[CollectiveBackend] = self._lookup("backend", name)
        return cls

    def middleware_class(self, name: str) -> type:
        """The middleware class registered as ``name``."""
        cls: type = self._lookup("middleware", name)
        return cls

    def names(self, kind: str) -> list[str]:
        """Names of every registered plugin item of ``kind`` (backend, middleware, adapter, kernels)."""
        return sorted({it.name for it in self._collect().by_kind.get(kind, [])})

    def make_backend(self, spec: str | CollectiveBackend | None = None) -> CollectiveBackend:
        """Build a backend from a spec such as ``"counting+coalescing+c10d"``.

        ``None`` means: ``$SHARDSCALE_BACKEND`` if set, else ``c10d`` when a
        process group is initialized, else ``local``. A backend object is
        returned as it is.
        """
        if spec is not None and not isinstance(spec, str):
            from shardscale.core._protocols import CollectiveBackend

            if not isinstance(spec, CollectiveBackend):
                raise TypeError(
                    f"backend must be a spec string such as 'c10d' or 'counting+c10d', or an "
                    f"object implementing CollectiveBackend (name, all_reduce, world_size, rank, "
                    f"group_ranks); got {type(spec).__name__} {spec!r}"
                )
            return spec
        source = "argument"
        if spec is None:
            env = os.environ.get(BACKEND_ENV, "").strip()
            if env:
                spec, source = env, f"${BACKEND_ENV}"
            else:
                spec, source = _automatic_backend(), "automatic choice"
        parts = [p.strip() for p in spec.split("+")]
        if not spec.strip() or any(not p for p in parts):
            raise ShardscaleError(
                f"backend spec {spec!r} (from {source}) has an empty name; write names joined by "
                "'+', middleware first and a backend last, e.g. 'counting+c10d'."
            )
        *middle, last = parts
        backend_names = self.names("backend")
        if last not in backend_names and ":" not in last and last in self.names("middleware"):
            raise ShardscaleError(
                f"backend spec {spec!r} (from {source}) ends in the middleware {last!r}; a chain "
                f"must end in a backend, e.g. '{spec}+c10d'. Backends: {', '.join(backend_names)}."
            )
        try:
            cls = self.backend_class(last)
        except PluginNotFoundError as exc:
            raise PluginNotFoundError(f"{exc} (requested by {source}: {spec!r})") from None
        reason = _unavailable_reason(cls)
        if reason is not None:
            usable = sorted(
                {
                    it.name
                    for it in self._collect().by_kind.get("backend", [])
                    if _unavailable_reason(it.obj) is None
                }
            )
            raise BackendUnavailableError(
                f"backend {last!r} cannot run here: {reason} (requested by {source}: {spec!r}). "
                f"Choose a backend that can, e.g. one of: {', '.join(usable) or '(none)'}."
            )
        backend: CollectiveBackend = cls()
        for mw_name in reversed(middle):
            if mw_name in backend_names and mw_name not in self.names("middleware"):
                raise ShardscaleError(
                    f"backend spec {spec!r}: {mw_name!r} is a backend, not a middleware; only the "
                    "last name in a chain may be a backend."
                )
            backend = self.middleware_class(mw_name)(backend)
        return backend

    def adapters(self) -> list[GradAdapter]:
        """Every grad adapter, highest priority first."""
        catalog = self._collect()
        if catalog.adapters_by_priority is None:
            items = catalog.by_kind.get("adapter", [])
            ranked = sorted(items, key=lambda it: -int(it.obj.priority))
            catalog.adapters_by_priority = [it.obj for it in ranked]
        return list(catalog.adapters_by_priority)

    def adapter_for(self, param: torch.Tensor) -> GradAdapter:
        """The adapter that describes ``param``'s gradient."""
        catalog = self._collect()
        if catalog.adapters_by_priority is None:
            self.adapters()
        for adapter in catalog.adapters_by_priority or ():
            if adapter.claims(param):
                return adapter
        from shardscale.core._plain_adapter import is_fsdp1_param

        if is_fsdp1_param(param):
            raise PluginNotFoundError(
                f"a parameter of shape {tuple(param.shape)} is managed by FSDP1 "
                "(FullyShardedDataParallel), but no installed adapter knows FSDP1: each rank "
                "holds a different shard, so treating it as a plain tensor would count one shard "
                "as the whole gradient. Install shardscale-fsdp ('pip install shardscale-fsdp'), "
                f"or remove it from ${DISABLE_ENV}. Installed adapters: "
                f"{', '.join(self.names('adapter')) or '(none)'}."
            )
        raise PluginNotFoundError(
            f"no grad adapter claims a parameter of type {type(param).__name__}; installed "
            f"adapters: {', '.join(self.names('adapter')) or '(none)'}. DTensor, FSDP1 and DDP "
            "parameters need 'pip install shardscale-fsdp'."
        )

    def kernels_for(self, device: torch.device, name: str | None = None) -> StatsKernels:
        """The statistics kernels to use on ``device`` (or the one called ``name``)."""
        if name is not None:
            kernels: StatsKernels = self._lookup("kernels", name)
            if not kernels.supports(device):
                raise BackendUnavailableError(
                    f"kernels {name!r} do not support device {device}; choose another with "
                    f"kernels=... (installed: {', '.join(self.names('kernels'))})"
                )
            return kernels
        items = self._collect().by_kind.get("kernels", [])
        for it in sorted(items, key=lambda it: -int(it.obj.priority)):
            if it.obj.supports(device):
                chosen: StatsKernels = it.obj
                return chosen
        raise PluginNotFoundError(
            f"no stats kernels support device {device}; installed: "
            f"{', '.join(self.names('kernels')) or '(none)'}"
        )

    # -- observers -----------------------------------------------------------------------------

    def has_step_observers(self) -> bool:
        """Whether any plugin implements ``shardscale_on_step`` (skip building records if not)."""
        self.load()
        return bool(self._pm.hook.shardscale_on_step.get_hookimpls())

    def notify_step(self, record: StepRecord) -> None:
        """Call every ``shardscale_on_step`` observer with ``record``."""
        self._pm.hook.shardscale_on_step(record=record)

    # -- listing -------------------------------------------------------------------------------

    def plugins(self) -> list[PluginInfo]:
        """Every registered plugin with its distribution, version and hooks."""
        self.load()
        out = []
        for name, plugin in self._pm.list_name_plugin():
            dist, version = self._origin(name)
            hooks = tuple(sorted(c.name for c in self._pm.get_hookcallers(plugin) or ()))
            out.append(PluginInfo(name, dist, version, hooks))
        return sorted(out, key=lambda p: p.name)

    def items(self) -> list[ItemInfo]:
        """Every named backend, middleware, adapter and kernels, with usability here."""
        out = []
        for kind, items in self._collect().by_kind.items():
            for it in items:
                dist, version = self._origin(it.plugin)
                reason = _unavailable_reason(it.obj)
                if reason is None and kind == "kernels":
                    reason = (
                        None if _supports_any(it.obj) else "no supported device on this machine"
                    )
                out.append(
                    ItemInfo(it.name, kind, it.plugin, dist, version, reason is None, reason)
                )
        return sorted(out, key=lambda i: (i.kind, i.name))

    def failures(self) -> list[LoadFailure]:
        """Plugins that were blocked or failed to import."""
        self.load()
        return list(self._failures)

    def hook_names(self) -> Iterator[str]:
        """Names of every hook specification."""
        yield from _hookspecs.HOOK_KINDS


def _supports_any(kernels: Any) -> bool:
    import torch

    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    return any(kernels.supports(d) for d in devices)


def _install_hint(kind: str, name: str) -> str:
    hints = {
        ("backend", "c10d"): "shardscale-collectives",
        ("backend", "gloo"): "shardscale-collectives",
        ("backend", "nccl"): "shardscale-collectives",
        ("middleware", "counting"): "shardscale-collectives",
        ("middleware", "coalescing"): "shardscale-collectives",
    }
    dist = hints.get((kind, name))
    return f" {name!r} comes with 'pip install {dist}'." if dist else ""


def _automatic_backend() -> str:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return "c10d"
    return "local"


def _ep_origin(ep: md.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return ("<unknown distribution>", "")
    return (dist.metadata["Name"] or dist.name, dist.version)


def _dist_version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return ""


_registry: Registry | None = None
_registry_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry (created on first use; entry points load lazily)."""
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = Registry()
        return _registry


def reset_registry() -> None:
    """Forget the process-wide registry so the next lookup reloads plugins (tests)."""
    global _registry
    with _registry_lock:
        _registry = None
