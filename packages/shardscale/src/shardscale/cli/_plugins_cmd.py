"""``shardscale plugins``: every registered backend, middleware, adapter, kernels, skip policy and observer, and whether it works here."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from shardscale.cli._plugin_timeout import add_plugin_timeout_option, load_plugins_with_limit

__all__ = ["add_plugins_parser", "collect_plugins", "run_plugins"]

_PLURAL = {"backend": "backends", "middleware": "middleware", "adapter": "adapters",
           "kernels": "kernels", "policy": "skip policies"}  # fmt: skip


def add_plugins_parser(sub: Any) -> argparse.ArgumentParser:
    """Register the ``plugins`` subcommand."""
    from shardscale.cli._cmdline import add_command, add_json_option

    p = add_command(
        sub,
        "plugins",
        help="list registered plugins and whether they are usable here",
        description="List every backend, middleware, grad adapter and stats kernels that "
        "installed plugins provide, with their distribution and version, whether each can run "
        "on this machine (and why not), and plugins that failed to load.",
    )
    add_json_option(p, what="the listing")
    add_plugin_timeout_option(p)
    p.set_defaults(func=run_plugins)
    return p


def collect_plugins() -> dict[str, Any]:
    """The listing as plain data: ``items``, ``plugins`` (modules), ``observers``, ``failures``
    and ``disable``.

    ``failures`` holds every plugin, hook or item that was set aside (one-line
    ``error`` and a ``fix``, never a traceback) or blocked; ``disable`` says what
    ``SHARDSCALE_DISABLE_PLUGINS`` blocked, which of its names matched nothing,
    and what remains of each kind.
    """
    import warnings

    from shardscale.core import PluginWarning, get_registry

    reg = get_registry()
    with warnings.catch_warnings():
        # Each warning is an entry of "failures" or "disable" below: do not print it twice.
        warnings.simplefilter("ignore", PluginWarning)
        items = reg.items()
        plugins = reg.plugins()
        failures = reg.failures()
        unmatched = reg.unmatched_disable_names()
    return {
        "items": [
            {
                "name": it.name,
                "kind": it.kind,
                "plugin": it.plugin,
                "distribution": it.distribution,
                "version": it.version,
                "priority": it.priority,
                "usable": it.usable,
                "reason": it.reason,
            }
            for it in items
        ],
        "plugins": [
            {
                "name": p.name,
                "distribution": p.distribution,
                "version": p.version,
                "hooks": list(p.hooks),
            }
            for p in plugins
        ],
        "observers": _observers(plugins),
        "failures": [
            {
                "name": f.name,
                "distribution": f.distribution,
                "version": f.version,
                "stage": f.stage,
                "error": f.error,
                "fix": f.fix,
                "blocked": f.blocked,
            }
            for f in failures
        ],
        "disable": {
            "blocked": sorted({f.name for f in failures if f.blocked}),
            "unmatched": unmatched,
            "remaining": {
                kind: sorted({it.name for it in items if it.kind == kind})
                for kind in ("backend", "middleware", "adapter", "kernels", "policy")
            },
        },
    }


def _observers(plugins: list[Any]) -> list[dict[str, Any]]:
    # Observers implement shardscale_on_step and have no item names of their own; the
    # telemetry distribution's plugin is listed as the observers it can write to.
    out: list[dict[str, Any]] = []
    for p in plugins:
        if "shardscale_on_step" not in p.hooks:
            continue
        kinds: dict[str, str | None] = {p.name: None}
        note: str | None = None
        if p.distribution == "shardscale-telemetry":
            try:
                from shardscale.telemetry import ENV, observer_kinds
            except ImportError:
                pass
            else:
                kinds = observer_kinds()
                note = f"off until {ENV} or telemetry.enable()"
        for name, reason in kinds.items():
            out.append({
                "name": name, "plugin": p.name, "distribution": p.distribution,
                "version": p.version, "usable": reason is None,
                "reason": reason,
                "note": note,
            })  # fmt: skip
    return out


def run_plugins(args: argparse.Namespace, *, stream: TextIO | None = None) -> int:
    """Print the listing; exit status 1 when a plugin failed (blocked ones are fine)."""
    from shardscale.cli._ui import print_table

    out = stream if stream is not None else sys.stdout
    load_plugins_with_limit(args.plugin_timeout)
    data = collect_plugins()
    broken = [f for f in data["failures"] if not f["blocked"]]
    if args.json:
        print(json.dumps(data, indent=2), file=out)
        return 1 if broken else 0
    rows = [
        (
            it["name"],
            it["kind"],
            "-" if it["priority"] is None else str(it["priority"]),
            it["distribution"],
            it["version"] or "-",
            "yes" if it["usable"] else f"no: {it['reason']}",
        )
        for it in data["items"]
    ] + [
        (
            ob["name"],
            "observer",
            "-",
            ob["distribution"],
            ob["version"] or "-",
            ("yes" + (f" ({ob['note']})" if ob["note"] else ""))
            if ob["usable"]
            else f"no: {ob['reason']}",
        )
        for ob in data["observers"]
    ]
    print_table(
        "shardscale plugins",
        rows,
        headers=("name", "kind", "priority", "distribution", "version", "usable here"),
        stream=out,
    )
    print(
        "Adapters and kernels are tried highest priority first; where two of equal priority "
        "both apply, the lookup is an error naming both (never install order).",
        file=out,
    )
    # Plugins with no hook (the trainer integrations, the schedules) own no row above: name them.
    bare = [p for p in data["plugins"] if not p["hooks"]]
    if bare:
        listed = ", ".join(f"{p['name']} ({p['distribution']} {p['version']})" for p in bare)
        print(f"also installed, used from code or frameworks, not the registry: {listed}", file=out)
    for f in data["failures"]:
        version = f" {f['version']}" if f["version"] else ""
        if f["blocked"]:
            print(f"plugin {f['name']!r} ({f['distribution']}{version}) blocked by "
                  "SHARDSCALE_DISABLE_PLUGINS: not imported", file=out)  # fmt: skip
        else:
            print(f"plugin {f['name']!r} ({f['distribution']}{version}) FAILED [{f['stage']}]: "
                  f"{f['error']}\n    fix: {f['fix']}", file=out)  # fmt: skip
    disable = data["disable"]
    if disable["unmatched"]:
        print(f"SHARDSCALE_DISABLE_PLUGINS names {', '.join(map(repr, disable['unmatched']))}, "
              "which match no installed plugin: they block nothing (check the spelling)",
              file=out)  # fmt: skip
    if disable["blocked"]:
        remains = "; ".join(
            f"{_PLURAL[kind]}: {', '.join(names) or '(none)'}"
            for kind, names in disable["remaining"].items()
        )
        print(f"with {', '.join(disable['blocked'])} blocked, what remains is {remains}", file=out)
    return 1 if broken else 0
