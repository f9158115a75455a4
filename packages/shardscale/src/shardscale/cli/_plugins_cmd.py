"""``shardscale plugins``: every registered backend, middleware, adapter, kernels and observer, and whether it works here."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

__all__ = ["add_plugins_parser", "collect_plugins", "run_plugins"]


def add_plugins_parser(sub: Any) -> argparse.ArgumentParser:
    """Register the ``plugins`` subcommand."""
    p: argparse.ArgumentParser = sub.add_parser(
        "plugins",
        help="list registered plugins and whether they are usable here",
        description="List every backend, middleware, grad adapter and stats kernels that "
        "installed plugins provide, with their distribution and version, whether each can run "
        "on this machine (and why not), and plugins that failed to load.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_plugins)
    return p


def collect_plugins() -> dict[str, Any]:
    """The listing as plain data: ``items``, ``plugins`` (modules), ``observers`` and ``failures``."""
    from shardscale.core import get_registry

    reg = get_registry()
    return {
        "items": [
            {
                "name": it.name,
                "kind": it.kind,
                "plugin": it.plugin,
                "distribution": it.distribution,
                "version": it.version,
                "usable": it.usable,
                "reason": it.reason,
            }
            for it in reg.items()
        ],
        "plugins": [
            {
                "name": p.name,
                "distribution": p.distribution,
                "version": p.version,
                "hooks": list(p.hooks),
            }
            for p in reg.plugins()
        ],
        "observers": _observers(reg.plugins()),
        "failures": [
            {
                "name": f.name,
                "distribution": f.distribution,
                "version": f.version,
                "error": f.error,
                "blocked": f.blocked,
            }
            for f in reg.failures()
        ],
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
    """Print the listing; exit status 1 when a plugin failed to load (blocked ones are fine)."""
    from shardscale.cli._ui import print_table

    out = stream if stream is not None else sys.stdout
    data = collect_plugins()
    broken = [f for f in data["failures"] if not f["blocked"]]
    if args.json:
        print(json.dumps(data, indent=2), file=out)
        return 1 if broken else 0
    rows = [
        (
            it["name"],
            it["kind"],
            it["distribution"],
            it["version"] or "-",
            "yes" if it["usable"] else f"no: {it['reason']}",
        )
        for it in data["items"]
    ] + [
        (
            ob["name"],
            "observer",
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
        headers=("name", "kind", "distribution", "version", "usable here"),
        stream=out,
    )
    # Plugins with no hook (the trainer integrations) own no row above: name them here.
    bare = [p for p in data["plugins"] if not p["hooks"]]
    if bare:
        names = ", ".join(f"{p['name']} ({p['distribution']} {p['version']})" for p in bare)
        print(f"also installed, used from their frameworks: {names}", file=out)
    for f in data["failures"]:
        what = "blocked" if f["blocked"] else "FAILED to load"
        print(f"plugin {f['name']!r} ({f['distribution']} {f['version']}) {what}: {f['error']}",
              file=out)  # fmt: skip
    return 1 if broken else 0
