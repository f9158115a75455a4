"""The plugin registry: one pluggy plugin manager fed by the ``shardscale`` entry points.

[Note: how plugins are found]
Plugins come from exactly two places: installed distributions that list a
module in the ``shardscale`` entry-point group, and objects registered
in-process with :meth:`Registry.register`. Nothing is ever imported from a path
or a module name taken from the environment. Entry points load lazily, on the
first lookup, once per process (see ``_plugin_loading`` for blocking with
``SHARDSCALE_DISABLE_PLUGINS`` and for isolation at import). The built-in
plugin of ``shardscale-core`` arrives through the same entry-point path as
everybody else's.

[Note: one bad plugin cannot break the house]
Every failure of a plugin becomes a :class:`LoadFailure` naming the plugin, its
distribution and version, and the fix, and the rest of the registry keeps
working: an import that raises anything but ``KeyboardInterrupt``; a hook that
raises or returns something other than a list; an item without a string name,
with a non-int priority or missing methods; an adapter's ``claims()`` or a
kernels' ``supports()`` that raises during a step; an observer that raises. The
last three are *set aside*: recorded once, warned about once
(:class:`PluginWarning`), and not consulted again in this process, so a plugin
that breaks at step 1000 behaves from then on as if it were not installed. An
observer that raises :class:`ObserverSettingError` (a bad setting of its own,
such as shardscale-telemetry's environment variable) is recorded and warned
about the same way but still called: the setting switches off only what it
configures.
In-process registration is stricter: :meth:`Registry.register` calls the new
plugin's hooks at once and refuses it, changing nothing, if any fails.

[Note: equal priorities]
Adapters and kernels are ranked by ``priority`` (higher first). Equal
priorities are never settled by install or discovery order: when two adapters
of equal priority both claim a parameter, or two kernels of equal priority
both support a device (and no ``kernels=`` name was given), the lookup raises
:class:`PluginConflictError` naming both. Where their claims do not overlap,
equal priorities are harmless and nothing is raised. In a step the error is
carried by the step's one collective, so every rank raises together.

[Note: the automatic backend]
With no backend named (no argument, no ``$SHARDSCALE_BACKEND``), a process
without an initialized process group gets core's own ``local``. With one, the
registry picks the usable backend class that declares the highest
``automatic_priority`` class attribute; core names no other distribution's
backend. No candidate, or two with the same highest value, is an error that
says what to set.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

from shardscale.core import _hookspecs
from shardscale.core._errors import (
    BackendUnavailableError,
    ObserverSettingError,
    PluginConflictError,
    PluginNotFoundError,
    PluginWarning,
    ShardscaleError,
)
from shardscale.core._plugin_items import call_item_hook
from shardscale.core._plugin_loading import (
    CORE_PLUGIN,
    DISABLE_ENV,
    LoadFailure,
    canonical_name,
    describe_exception,
    failure_fix,
    load_plugins,
)
from shardscale.core._protocols import claims_type_of

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

BACKEND_ENV = "SHARDSCALE_BACKEND"
#: The "distribution" reported for plugins registered in-process.
IN_PROCESS = "<in-process>"
_ITEM_KINDS = ("backend", "middleware", "adapter", "kernels", "policy")


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """One registered plugin (a module or object) and where it came from."""

    name: str
    distribution: str
    version: str
    hooks: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ItemInfo:
    """One named thing a plugin provides: a backend, middleware, adapter or kernels.

    ``priority`` is the rank of an adapter or kernels (``None`` for backends and
    middleware); ``reason`` says why an unusable item cannot run here.
    """

    name: str
    kind: str
    plugin: str
    distribution: str
    version: str
    usable: bool
    reason: str | None = None
    priority: int | None = None


@dataclass(slots=True)
class _Item:
    name: str
    kind: str
    obj: Any
    plugin: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.plugin, self.kind, self.name)


@dataclass(slots=True)
class _Catalog:
    by_kind: dict[str, list[_Item]] = field(default_factory=dict)
    failures: list[LoadFailure] = field(default_factory=list)
    # Adapters are consulted once per parameter per step: rank them once per catalog.
    adapters_ranked: list[_Item] | None = None
    # id(adapter item) -> the other adapters of the same priority (empty almost always).
    adapter_rivals: dict[int, list[_Item]] = field(default_factory=dict)
    kernels_by_device: dict[str, Any] = field(default_factory=dict)
    # type(param) -> its adapter, where every adapter answered by type (``claims_type``);
    # None: some adapter must look at the parameter itself.
    adapter_by_type: dict[type, Any] = field(default_factory=dict)


def _unavailable_reason(obj: Any) -> str | None:
    probe = getattr(obj, "unavailable_reason", None)
    if probe is None:
        return None
    try:
        reason = probe()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a broken probe must not break listing
        return f"availability check failed: {describe_exception(exc)}"
    return None if reason is None else str(reason)


class Registry:
    """shardscale's plugin manager, with a typed lookup per kind of plugin."""

    def __init__(self, *, load_entry_points: bool = True) -> None:
        self._load_entry_points = load_entry_points
        self._lock = threading.RLock()
        self._pm = self._new_manager()
        self._loaded = False
        self._origins: dict[str, tuple[str, str]] = {}
        self._failures: list[LoadFailure] = []
        self._unmatched: tuple[str, ...] = ()
        # Items and observers set aside during steps: (plugin, kind, name) -> their failure.
        self._set_aside: dict[tuple[str, str, str], LoadFailure] = {}
        # Observers that reported a bad setting of their own: recorded, still called.
        self._reported: dict[tuple[str, str, str], LoadFailure] = {}
        self._catalog: _Catalog | None = None

    @staticmethod
    def _new_manager() -> pluggy.PluginManager:
        pm = pluggy.PluginManager(_hookspecs.PROJECT)
        pm.add_hookspecs(_hookspecs)
        return pm

    # -- loading -------------------------------------------------------------------------------

    def load(self, *, import_timeout: float | None = None) -> None:
        """Load installed plugins (once). Lookups call this for you.

        Loading builds a new plugin manager and swaps it in only when every
        plugin has been tried, so the registry is never seen half-loaded; a
        ``KeyboardInterrupt`` during loading leaves it unloaded.
        ``import_timeout`` (seconds) gives each plugin's import a time limit,
        for commands that must finish (``shardscale doctor``/``plugins``): one
        that does not return in time is a failure naming it (see
        [Note: a time limit on import] in ``_plugin_loading``). It has no
        effect once the registry is loaded.
        """
        with self._lock:
            if self._loaded:
                return
            pm = self._new_manager()
            result = load_plugins(
                pm, entry_points=self._load_entry_points, import_timeout=import_timeout
            )
            self._pm, self._origins = pm, result.origins
            self._failures, self._unmatched = result.failures, result.unmatched
            self._catalog = None
            self._loaded = True
        for failure in result.failures:
            if not failure.blocked:
                _warn(failure)
        if result.unmatched:
            warnings.warn(
                f"{DISABLE_ENV} names {', '.join(repr(n) for n in result.unmatched)}, which "
                "match no installed shardscale plugin, so they block nothing. Entry-point and "
                f"distribution names installed: {', '.join(result.known_names)}.",
                PluginWarning,
                stacklevel=3,
            )

    def register(self, plugin: object, *, name: str | None = None) -> str:
        """Register a plugin object in-process (tests, notebooks). Returns its name.

        Its hooks are called at once; if one fails the plugin is refused with a
        :class:`ShardscaleError` and the registry is left as it was. Unregister
        it with :meth:`unregister`, typically in a ``finally`` block.
        """
        self.load()
        with self._lock:
            plugin_name = name or getattr(plugin, "__name__", None) or f"plugin-{id(plugin):x}"
            if plugin_name in self._origins:
                raise PluginConflictError(
                    f"a plugin named {plugin_name!r} is already registered (from "
                    f"{self._origins[plugin_name][0]}); pass another name=..."
                )
            try:
                self._pm.register(plugin, name=plugin_name)
            except Exception as exc:  # pluggy: the same object twice, or a bad hook signature
                raise ShardscaleError(f"cannot register {plugin_name!r}: {exc}") from exc
            _, problems = self._collect_plugin(plugin_name)
            if problems:
                self._pm.unregister(plugin, name=plugin_name)
                said = "; ".join(
                    f"plugin {plugin_name!r} {p}" if p.startswith("returned") else p
                    for p in problems
                )
                raise ShardscaleError(
                    f"{said}. The in-process plugin {plugin_name!r} was not registered: fix it "
                    "and register it again."
                )
            self._origins[plugin_name] = (IN_PROCESS, "")
            self._catalog = None
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
            for failed in (self._set_aside, self._reported):
                for key in [k for k in failed if k[0] == name]:
                    del failed[key]
            self._catalog = None

    # -- catalog -------------------------------------------------------------------------------

    def _collect_plugin(self, plugin_name: str) -> tuple[list[_Item], list[str]]:
        """Call each item hook of one plugin on its own: (well-formed items, problems)."""
        items: list[_Item] = []
        problems: list[str] = []
        for hook_name, kind in _hookspecs.HOOK_KINDS.items():
            for impl in getattr(self._pm.hook, hook_name).get_hookimpls():
                if impl.plugin_name != plugin_name:
                    continue
                if impl.hookwrapper or impl.wrapper:
                    # Each plugin's hook is called on its own, so there is nothing to wrap.
                    problems.append(
                        f"{hook_name}() is a hook wrapper, which shardscale does not call; "
                        "drop wrapper=True/hookwrapper=True and return (or observe) directly"
                    )
                    continue
                if kind not in _ITEM_KINDS:
                    continue
                objs, bad = call_item_hook(impl.function, hook_name, kind)
                items += [_Item(str(obj.name), kind, obj, plugin_name) for obj in objs]
                problems += bad
        return items, problems

    def _collect(self) -> _Catalog:
        self.load()
        with self._lock:
            if self._catalog is not None:
                return self._catalog
            catalog = _Catalog(by_kind={kind: [] for kind in _ITEM_KINDS})
            for plugin_name, _ in sorted(self._pm.list_name_plugin(), key=lambda np: np[0]):
                items, problems = self._collect_plugin(plugin_name)
                for it in items:
                    if it.key not in self._set_aside:
                        catalog.by_kind[it.kind].append(it)
                dist, version = self._origin(plugin_name)
                catalog.failures += [
                    LoadFailure(
                        plugin_name,
                        dist,
                        version,
                        problem,
                        fix=failure_fix(plugin_name, dist),
                        stage="item" if problem.startswith("returned") else "hook",
                    )
                    for problem in problems
                ]
            self._catalog = catalog
        for failure in catalog.failures:
            _warn(failure)
        return catalog

    def _origin(self, plugin: str) -> tuple[str, str]:
        return self._origins.get(plugin, (IN_PROCESS, ""))

    def _describe_item(self, it: _Item) -> str:
        dist, version = self._origin(it.plugin)
        return f"{it.kind} {it.name!r} from {dist} {version}".rstrip() + f" (plugin {it.plugin!r})"

    def _set_item_aside(
        self, it: _Item, stage: str, exc: BaseException, *, keep: bool = False
    ) -> None:
        """Record that ``it`` failed during a step and stop consulting it (see the Note above).

        With ``keep`` (an observer's :class:`ObserverSettingError`) it is
        recorded and warned about once, but still consulted.
        """
        dist, version = self._origin(it.plugin)
        consequence = (
            "it is still called (a setting of its own is wrong, not the plugin)"
            if keep
            else "it is no longer consulted in this process"
        )
        failure = LoadFailure(
            it.plugin,
            dist,
            version,
            f"{it.kind} {it.name!r}: {stage}() raised {describe_exception(exc)}; {consequence}",
            fix=_own_fix(exc) or failure_fix(it.plugin, dist),
            stage=stage,
        )
        with self._lock:
            if it.key in self._set_aside or it.key in self._reported:
                return
            if keep:
                self._reported[it.key] = failure
            else:
                self._set_aside[it.key] = failure
                self._catalog = None
        _warn(failure)

    def _matches(self, kind: str, name: str) -> list[_Item]:
        items = self._collect().by_kind.get(kind, [])
        qualifier, _, bare = name.rpartition(":")
        wanted = canonical_name(qualifier)
        return [
            it
            for it in items
            if it.name == bare
            and (
                not qualifier
                or qualifier == it.plugin
                or wanted == canonical_name(self._origin(it.plugin)[0])
            )
        ]

    def _lookup(self, kind: str, name: str) -> Any:
        matches = self._matches(kind, name)
        bare = name.rpartition(":")[2]
        if not matches:
            available = sorted({it.name for it in self._collect().by_kind.get(kind, [])})
            raise PluginNotFoundError(
                f"no {kind} named {name!r}: misspelled or not installed. "
                f"Installed {kind}s: {', '.join(available) or '(none)'}."
                + self._failures_hint()
                + " 'shardscale plugins' lists every plugin and where it comes from."
            )
        if len(matches) > 1:
            owners = " and ".join(
                f"{self._origin(m.plugin)[0]} (plugin {m.plugin!r})" for m in matches
            )
            raise PluginConflictError(
                f"the {kind} name {bare!r} is claimed by {owners}. Pick one explicitly as "
                f"'<distribution>:{bare}', e.g. {self._origin(matches[0].plugin)[0]}:{bare}, "
                f"or block one with {DISABLE_ENV}=<distribution>."
            )
        return matches[0].obj

    def _failures_hint(self) -> str:
        # The name may belong to a plugin that did not load: say so rather than "not installed".
        failures = self.failures()
        if not failures:
            return ""
        parts = [
            f"{f.name} ({f.distribution}): {'blocked' if f.blocked else f.error}" for f in failures
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

    def policy_class(self, name: str) -> type:
        """The skip policy class registered as ``name`` (see :meth:`skip_policies`)."""
        self.skip_policies()  # duplicate names or codes are an error, named
        cls: type = self._lookup("policy", name)
        return cls

    def skip_policies(self) -> dict[str, type]:
        """Every registered skip policy class by name.

        Two plugins registering the same policy name, reason code or precedence
        raise :class:`PluginConflictError` naming both distributions: the
        verdict's reason must name exactly one policy.
        """
        items = self._collect().by_kind.get("policy", [])
        out: dict[str, type] = {}
        for attr in ("name", "code", "precedence"):
            seen: dict[object, _Item] = {}
            for it in items:
                key = getattr(it.obj, attr)
                other = seen.setdefault(key, it)
                if other is not it:
                    raise PluginConflictError(
                        f"the skip policy {attr} {key!r} is claimed by "
                        f"{self._origin(other.plugin)[0]} (plugin {other.plugin!r}, "
                        f"{other.obj.__qualname__}) and {self._origin(it.plugin)[0]} (plugin "
                        f"{it.plugin!r}, {it.obj.__qualname__}); uninstall one, or block it with "
                        f"{DISABLE_ENV}=<distribution>"
                    )
        for it in items:
            out[it.name] = it.obj
        return out

    def names(self, kind: str) -> list[str]:
        """Names of every registered plugin item of ``kind`` (backend, middleware, adapter, kernels)."""
        return sorted({it.name for it in self._collect().by_kind.get(kind, [])})

    def backend_spec(
        self, spec: str | None = None, *, distributed: bool | None = None
    ) -> tuple[str, str]:
        """The backend chain :meth:`make_backend` builds for ``spec``, and where it came from.

        ``None`` means ``$SHARDSCALE_BACKEND`` if set, else the automatic
        choice (see [Note: the automatic backend]); ``distributed`` says whether
        to choose as if a default process group were initialized (default: look).
        Returns ``(spec, source)``, e.g. ``("collectives:c10d", "automatic choice")``.
        """
        if spec is not None:
            return spec, "argument"
        env = os.environ.get(BACKEND_ENV, "").strip()
        if env:
            return env, f"${BACKEND_ENV}"
        if distributed is None:
            distributed = _process_group_initialized()
        return self._automatic_backend(distributed), "automatic choice"

    def _automatic_backend(self, distributed: bool) -> str:
        if not distributed:
            return f"{CORE_PLUGIN}:local"  # core's own item
        ranked: list[tuple[int, _Item]] = []
        for it in self._collect().by_kind.get("backend", []):
            priority = getattr(it.obj, "automatic_priority", None)
            if isinstance(priority, int) and _unavailable_reason(it.obj) is None:
                ranked.append((priority, it))
        if not ranked:
            raise PluginNotFoundError(
                "a process group is initialized, but no installed backend offers itself for the "
                "automatic choice (a backend class with an int 'automatic_priority'). Installed "
                f"backends: {', '.join(self.names('backend')) or '(none)'}. Name one with "
                f"backend=... or ${BACKEND_ENV}, or install a distribution that provides a "
                "torch.distributed backend." + self._failures_hint()
            )
        best = max(p for p, _ in ranked)
        tied = [it for p, it in ranked if p == best]
        if len(tied) > 1:
            raise PluginConflictError(
                f"{' and '.join(self._describe_item(it) for it in tied)} both declare "
                f"automatic_priority {best}, so neither is the automatic choice. Name one with "
                f"backend='<plugin>:<name>' or ${BACKEND_ENV}, or block one with {DISABLE_ENV}."
            )
        return f"{tied[0].plugin}:{tied[0].name}"

    def make_backend(
        self, spec: str | CollectiveBackend | None = None, *, source: str | None = None
    ) -> CollectiveBackend:
        """Build a backend from a spec such as ``"counting+coalescing+c10d"``.

        ``None`` means: ``$SHARDSCALE_BACKEND`` if set, else the automatic
        choice: ``local`` without a process group, else the installed backend
        with the highest ``automatic_priority`` (``c10d`` with
        shardscale-collectives). A backend object is returned as it is.
        ``source`` names where a spec string came from in error messages
        (default: "argument"), e.g. for a spec :meth:`backend_spec` returned.
        """
        if spec is not None and not isinstance(spec, str):
            from shardscale.core._protocols import CollectiveBackend

            if not isinstance(spec, CollectiveBackend):
                raise TypeError(
                    f"backend must be a spec string such as 'local' or '<middleware>+<backend>', or an "
                    f"object implementing CollectiveBackend (name, all_reduce, world_size, rank, "
                    f"group_ranks); got {type(spec).__name__} {spec!r}"
                )
            return spec
        spec, found_in = self.backend_spec(spec)
        source = source or found_in
        parts = [p.strip() for p in spec.split("+")]
        if not spec.strip() or any(not p for p in parts):
            raise ShardscaleError(
                f"backend spec {spec!r} (from {source}) has an empty name; write names joined by "
                f"'+', middleware first and a backend last, e.g. {self._example_chain()}."
            )
        *middle, last = parts
        backend_names = self.names("backend")
        if not self._matches("backend", last) and self._matches("middleware", last):
            raise ShardscaleError(
                f"backend spec {spec!r} (from {source}) ends in the middleware {last!r}; a chain "
                f"must end in a backend, e.g. {self._example_chain(spec)}. Backends: "
                f"{', '.join(backend_names) or '(none)'}."
            )
        try:
            cls = self.backend_class(last)
        except PluginNotFoundError as exc:
            raise PluginNotFoundError(f"{exc} (requested by {source}: {spec!r})") from None
        except PluginConflictError as exc:
            raise PluginConflictError(f"{exc} (requested by {source}: {spec!r})") from None
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
            if self._matches("backend", mw_name) and not self._matches("middleware", mw_name):
                raise ShardscaleError(
                    f"backend spec {spec!r}: {mw_name!r} is a backend, not a middleware; only the "
                    "last name in a chain may be a backend."
                )
            backend = self.middleware_class(mw_name)(backend)
        return backend

    def _example_chain(self, middleware: str | None = None) -> str:
        """A chain to show in an error message, made of what is installed here."""
        try:
            backend = self._automatic_backend(True).rpartition(":")[2]
        except ShardscaleError:
            backend = "local" if "local" in self.names("backend") else "<backend>"
        if middleware is None:
            installed = self.names("middleware")
            middleware = installed[0] if installed else "<middleware>"
        return f"'{middleware}+{backend}'"

    def _ranked_adapters(self) -> tuple[list[_Item], dict[int, list[_Item]]]:
        """Adapters highest priority first, and each one's equal-priority rivals."""
        catalog = self._collect()
        ranked = catalog.adapters_ranked
        if ranked is None:
            items = catalog.by_kind.get("adapter", [])
            # Ties are settled in adapter_for, never by this order (see [Note: equal priorities]).
            ranked = sorted(items, key=lambda it: (-int(it.obj.priority), it.plugin, it.name))
            rivals: dict[int, list[_Item]] = {}
            for it in ranked:
                same = [o for o in ranked if o is not it and o.obj.priority == it.obj.priority]
                if same:
                    rivals[id(it)] = same
            catalog.adapter_rivals = rivals
            catalog.adapters_ranked = ranked
        return ranked, catalog.adapter_rivals

    def adapters(self) -> list[GradAdapter]:
        """Every grad adapter, highest priority first (equal priorities: see the module Note)."""
        return [it.obj for it in self._ranked_adapters()[0]]

    def _ask(self, it: _Item, stage: str, arg: object) -> bool:
        """``it.obj.<stage>(arg)``; a plugin that raises is set aside and answers no."""
        try:
            return bool(getattr(it.obj, stage)(arg))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # see [Note: one bad plugin cannot break the house]
            self._set_item_aside(it, stage, exc)
            return False

    def _claims(self, it: _Item, param: torch.Tensor) -> bool:
        return self._ask(it, "claims", param)

    def catalog_token(self) -> object:
        """An object that stays the same until a plugin is registered, removed or set aside.

        The step plan (``_step_plan``) keeps which adapter owns each gradient
        only as long as this token is the same.
        """
        return self._collect()

    def adapter_for(self, param: torch.Tensor) -> GradAdapter:
        """The adapter that describes ``param``'s gradient."""
        # Called once per parameter per step: read the ranked list without the lock when ready.
        catalog = self._catalog
        if catalog is not None and catalog.adapters_ranked is not None:
            ranked, rivals = catalog.adapters_ranked, catalog.adapter_rivals
        else:
            ranked, rivals = self._ranked_adapters()
            catalog = self._collect()
        kind = type(param)
        if kind not in catalog.adapter_by_type:
            catalog.adapter_by_type[kind] = self._adapter_by_type(ranked, rivals, kind)
        by_type: GradAdapter | None = catalog.adapter_by_type[kind]
        if by_type is not None:
            return by_type
        for it in ranked:
            if not self._claims(it, param):
                continue
            same = [o for o in rivals.get(id(it), ()) if self._claims(o, param)] if rivals else []
            if same:
                raise PluginConflictError(
                    f"{' and '.join(self._describe_item(x) for x in (it, *same))} all claim a "
                    f"parameter of type {type(param).__name__} and shape {tuple(param.shape)} "
                    f"with the same priority {it.obj.priority}; shardscale does not choose "
                    f"between equals by install order. Block one with {DISABLE_ENV}=<distribution>,"
                    " or ask their authors for distinct priorities."
                )
            adapter: GradAdapter = it.obj
            return adapter
        from shardscale.core._plain_adapter import is_fsdp1_param

        installed = ", ".join(self.names("adapter")) or "(none)"
        if is_fsdp1_param(param):
            raise PluginNotFoundError(
                f"a parameter of shape {tuple(param.shape)} is managed by FSDP1 "
                "(FullyShardedDataParallel), but no installed adapter knows FSDP1: each rank "
                "holds a different shard, so treating it as a plain tensor would count one shard "
                "as the whole gradient. Install shardscale-fsdp ('pip install shardscale-fsdp'), "
                f"or remove it from ${DISABLE_ENV}. Installed adapters: {installed}."
                + self._failures_hint()
            )
        raise PluginNotFoundError(
            f"no grad adapter claims a parameter of type {type(param).__name__}; installed "
            f"adapters: {installed}. DTensor, FSDP1 and DDP parameters need "
            "'pip install shardscale-fsdp'." + self._failures_hint()
        )

    def adapter_for_type(self, kind: type) -> GradAdapter | None:
        """The adapter of every parameter of class ``kind``; None when it depends on the parameter.

        None also when no adapter or several equal ones would claim: :meth:`adapter_for`, asked
        per parameter, then names the problem.
        """
        ranked, rivals = self._ranked_adapters()
        catalog = self._collect()
        if kind not in catalog.adapter_by_type:
            catalog.adapter_by_type[kind] = self._adapter_by_type(ranked, rivals, kind)
        found: GradAdapter | None = catalog.adapter_by_type[kind]
        return found

    def _adapter_by_type(
        self, ranked: list[_Item], rivals: dict[int, list[_Item]], kind: type
    ) -> GradAdapter | None:
        """The adapter of every parameter of class ``kind``, when each adapter can say by class.

        Adapters may answer ``claims_type(kind)``: True (claims every
        parameter of that class), False (none), None (it depends on the
        parameter). With thousands of parameters of one class (FSDP2's
        DTensors) this spares a ``claims`` call per adapter per parameter.
        """
        for it in ranked:
            probe = claims_type_of(it.obj)
            try:
                answer = probe(kind) if probe is not None else None
            except Exception:
                return None  # the per-parameter path asks claims() and sets a broken one aside
            if answer is not True and answer is not False:
                return None
            if answer:
                # Equal-priority rivals are reported by the per-parameter path.
                found: GradAdapter | None = None if rivals.get(id(it)) else it.obj
                return found
        return None

    def _supports(self, it: _Item, device: torch.device) -> bool:
        return self._ask(it, "supports", device)

    def kernels_for(self, device: torch.device, name: str | None = None) -> StatsKernels:
        """The statistics kernels to use on ``device`` (or the one called ``name``)."""
        if name is not None:
            matches = self._matches("kernels", name)
            kernels: StatsKernels = self._lookup("kernels", name)
            if not self._supports(matches[0], device):
                failed = self._set_aside.get(matches[0].key)
                if failed is not None:
                    raise BackendUnavailableError(
                        f"kernels {name!r} failed on device {device}: {failed.error}. Fix: "
                        f"{failed.fix}; or choose other kernels with kernels=..."
                    )
                reason = _unavailable_reason(kernels)
                raise BackendUnavailableError(
                    f"kernels {name!r} do not support device {device}"
                    + (f" ({reason})" if reason else "")
                    + f"; choose another with kernels=... (installed: "
                    f"{', '.join(self.names('kernels'))})"
                )
            return kernels
        catalog = self._collect()
        cached = catalog.kernels_by_device.get(str(device))
        if cached is not None:
            chosen: StatsKernels = cached
            return chosen
        items = catalog.by_kind.get("kernels", [])
        ranked = sorted(items, key=lambda it: (-int(it.obj.priority), it.plugin, it.name))
        for it in ranked:
            if not self._supports(it, device):
                continue
            same = [
                o
                for o in ranked
                if o is not it and o.obj.priority == it.obj.priority and self._supports(o, device)
            ]
            if same:
                raise PluginConflictError(
                    f"{' and '.join(self._describe_item(x) for x in (it, *same))} all support "
                    f"device {device} with the same priority {it.obj.priority}; shardscale does "
                    "not choose between equals by install order. Name one with "
                    f"kernels='<distribution>:<name>', or block one with {DISABLE_ENV}."
                )
            # Cache in the catalog read above: if a probe set something aside, that one is stale.
            catalog.kernels_by_device[str(device)] = it.obj
            chosen = it.obj
            return chosen
        unusable = [
            f"{it.name} ({_unavailable_reason(it.obj) or 'does not support it'})"
            for it in self._collect().by_kind.get("kernels", [])
        ]
        raise PluginNotFoundError(
            f"no stats kernels support device {device}; installed: "
            f"{', '.join(unusable) or '(none)'}." + self._failures_hint()
        )

    # -- observers -----------------------------------------------------------------------------

    def _observer_impls(self) -> list[Any]:
        self.load()
        impls = self._pm.hook.shardscale_on_step.get_hookimpls()
        # pluggy calls the last registered first; keep that order, minus the ones set aside.
        return [
            impl
            for impl in reversed(impls)
            if not (impl.hookwrapper or impl.wrapper)  # reported as a failure by _collect
            and (impl.plugin_name, "observer", "shardscale_on_step") not in self._set_aside
        ]

    def has_step_observers(self) -> bool:
        """Whether any plugin implements ``shardscale_on_step`` (skip building records if not)."""
        return bool(self._observer_impls())

    def notify_step(self, record: StepRecord) -> None:
        """Call every ``shardscale_on_step`` observer with ``record``, each on its own.

        An observer that raises is recorded, warned about and not called again
        (one that raises :class:`ObserverSettingError` is recorded and warned
        about, and still called); the step it observed is already complete and
        is not affected.
        """
        for impl in self._observer_impls():
            try:
                impl.function(**{arg: record for arg in impl.argnames})
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # see [Note: one bad plugin cannot break the house]
                item = _Item("shardscale_on_step", "observer", impl.function, impl.plugin_name)
                keep = isinstance(exc, ObserverSettingError)
                self._set_item_aside(item, "observer", exc, keep=keep)

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
                if reason is None and kind == "kernels" and not self._supports_any(it):
                    reason = "no supported device on this machine"
                priority = int(it.obj.priority) if kind in ("adapter", "kernels") else None
                if kind == "policy":  # a skip policy's rank is its precedence
                    priority = int(it.obj.precedence)
                out.append(
                    ItemInfo(
                        it.name, kind, it.plugin, dist, version, reason is None, reason, priority
                    )
                )
        return sorted(out, key=lambda i: (i.kind, -(i.priority or 0), i.name, i.plugin))

    def _supports_any(self, it: _Item) -> bool:
        import torch

        devices = [torch.device("cpu")]
        if torch.cuda.is_available():
            devices.append(torch.device("cuda"))
        return any(self._supports(it, d) for d in devices)

    def failures(self) -> list[LoadFailure]:
        """Plugins (or their hooks or items) that failed, were set aside, or were blocked."""
        catalog = self._collect()
        with self._lock:
            return [
                *self._failures,
                *catalog.failures,
                *self._set_aside.values(),
                *self._reported.values(),
            ]

    def unmatched_disable_names(self) -> list[str]:
        """Names in ``$SHARDSCALE_DISABLE_PLUGINS`` that matched no installed plugin."""
        self.load()
        return list(self._unmatched)

    def hook_names(self) -> Iterator[str]:
        """Names of every hook specification."""
        yield from _hookspecs.HOOK_KINDS


def _warn(failure: LoadFailure) -> None:
    version = f" {failure.version}" if failure.version else ""
    warnings.warn(
        f"shardscale plugin {failure.name!r} ({failure.distribution}{version}) failed and is "
        f"left out: {failure.error}. Everything else still works. Fix: {failure.fix}.",
        PluginWarning,
        stacklevel=4,
    )


def _process_group_initialized() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


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


def _own_fix(exc: BaseException) -> str | None:
    # A plugin's exception may say what fixes it (a bad setting rather than a broken install).
    fix = getattr(exc, "fix", None)
    return fix if isinstance(fix, str) and fix else None
