"""``shardscale env``: the environment as one block to paste into an issue, or as JSON.

In the manner of ``accelerate env``, ``transformers env`` and ``python -m
torch.utils.collect_env``: Python and OS, torch's build (CUDA, cuDNN, NCCL, the
GPUs it sees), every installed ``shardscale-*`` distribution with its version
(and whether it is an editable install), the training frameworks we integrate
with (those installed), the plugins the registry loaded and the ones that
failed, and the ``SHARDSCALE_*`` variables that steer them. ``shardscale
doctor --json`` carries the same data under ``"environment"``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import metadata
from typing import Any, TextIO

__all__ = ["FRAMEWORKS", "add_env_parser", "collect_environment", "format_environment", "run_env"]

#: The frameworks we integrate with or build on, reported when installed (distribution names).
FRAMEWORKS = (
    "lightning",
    "pytorch-lightning",
    "accelerate",
    "transformers",
    "trl",
    "torchtitan",
    "verl",
    "rlinf",
    "triton",
    "pluggy",
    "numpy",
    "rich",
    "matplotlib",
)


def add_env_parser(sub: Any) -> argparse.ArgumentParser:
    """Register the ``env`` subcommand."""
    from shardscale.cli._cmdline import add_command, add_json_option
    from shardscale.cli._plugin_timeout import add_plugin_timeout_option

    p = add_command(
        sub,
        "env",
        help="print the environment to paste into an issue (versions, GPUs, plugins)",
        description="Print Python, the OS, torch's build with CUDA and NCCL, the GPUs, every "
        "installed shardscale distribution, the frameworks and the plugins, as one block to "
        "paste into a bug report. Loads plugins (each import time-limited) but runs nothing.",
    )
    add_json_option(p, what="the environment")
    add_plugin_timeout_option(p)
    p.set_defaults(func=run_env)
    return p


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _editable(dist: metadata.Distribution) -> bool:
    text = dist.read_text("direct_url.json")
    if not text:
        return False
    try:
        info = json.loads(text)
    except ValueError:
        return False
    return bool(isinstance(info, dict) and info.get("dir_info", {}).get("editable"))


def _distributions() -> list[dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for dist in metadata.distributions():
        name = _canonical(dist.metadata["Name"] or "")
        if (name == "shardscale" or name.startswith("shardscale-")) and name not in seen:
            seen[name] = {"name": name, "version": dist.version, "editable": _editable(dist)}
    return [seen[k] for k in sorted(seen)]


def _frameworks() -> dict[str, str]:
    found: dict[str, str] = {}
    for name in FRAMEWORKS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def _untyped(fn: Any) -> Any:
    """torch's version getters carry no annotations; call them as ``Any``."""
    return fn


def _torch() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "version": torch.__version__,
        "debug_build": bool(torch.version.debug),
        "cuda_build": torch.version.cuda,
        "hip_build": getattr(torch.version, "hip", None),
        "cudnn": _untyped(torch.backends.cudnn.version)() if cuda else None,
        "cuda_available": cuda,
        "distributed": dist.is_available(),
        "gloo": bool(dist.is_available() and dist.is_gloo_available()),
        "nccl": bool(dist.is_available() and dist.is_nccl_available()),
        "nccl_version": None,
        "gpus": [],
    }
    if cuda:
        try:
            nccl = _untyped(torch.cuda.nccl.version)()
            info["nccl_version"] = (
                ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
            )
        except (RuntimeError, AttributeError):
            info["nccl_version"] = None
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            info["gpus"].append({
                "index": i,
                "name": prop.name,
                "capability": f"{prop.major}.{prop.minor}",
                "memory_gib": round(prop.total_memory / 2**30, 1),
            })  # fmt: skip
    return info


def _plugins() -> dict[str, Any]:
    from shardscale.cli._plugins_cmd import collect_plugins

    data = collect_plugins()
    return {
        "loaded": [
            {"name": p["name"], "distribution": p["distribution"], "version": p["version"]}
            for p in data["plugins"]
        ],
        "failed": [
            {
                "name": f["name"],
                "distribution": f["distribution"],
                "blocked": f["blocked"],
                "error": f["error"],
            }
            for f in data["failures"]
        ],
    }


def collect_environment() -> dict[str, Any]:
    """The environment as plain data (what ``shardscale env --json`` prints).

    Plugins are read from the process's registry, loading it if needed; the
    commands load it first with a time limit on each import.
    """
    variables = {
        key: value
        for key, value in sorted(os.environ.items())
        if key.startswith("SHARDSCALE_") or key in ("CUDA_VISIBLE_DEVICES", "NCCL_DEBUG")
    }
    return {
        "shardscale": _distributions(),
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "os": {"platform": platform.platform(), "machine": platform.machine()},
        "cpu_count": os.cpu_count(),
        "torch": _torch(),
        "frameworks": _frameworks(),
        "plugins": _plugins(),
        "variables": variables,
    }


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def format_environment(env: dict[str, Any]) -> str:
    """The environment as a Markdown list, ready to paste into an issue."""
    t = env["torch"]
    lines = [
        "Copy and paste this into your issue:",
        "",
        *(
            f"- {d['name']}: {d['version']}" + (" (editable)" if d["editable"] else "")
            for d in env["shardscale"]
        ),
        f"- Python: {env['python']['version']} ({env['python']['implementation']}, "
        f"{env['python']['executable']})",
        f"- OS: {env['os']['platform']} ({env['os']['machine']}, {env['cpu_count']} CPUs)",
        f"- torch: {t['version']}" + (" (debug build)" if t["debug_build"] else ""),
        f"- torch built with CUDA: {t['cuda_build'] or 'no'}"
        + (f", ROCm/HIP {t['hip_build']}" if t["hip_build"] else ""),
        f"- CUDA available: {_yes(t['cuda_available'])}"
        + (f", cuDNN {t['cudnn']}" if t["cudnn"] else ""),
        "- GPUs: "
        + (
            "; ".join(
                f"{g['index']}: {g['name']} (sm {g['capability']}, {g['memory_gib']} GiB)"
                for g in t["gpus"]
            )
            or "none"
        ),
        f"- torch.distributed: {_yes(t['distributed'])}; gloo: {_yes(t['gloo'])}; "
        f"NCCL: {_yes(t['nccl'])}" + (f" {t['nccl_version']}" if t["nccl_version"] else ""),
        "- frameworks: "
        + (", ".join(f"{k} {v}" for k, v in env["frameworks"].items()) or "none installed"),
        "- plugins: "
        + (
            ", ".join(
                f"{p['name']} ({p['distribution']} {p['version']})"
                for p in env["plugins"]["loaded"]
            )
            or "none"
        ),
    ]
    for f in env["plugins"]["failed"]:
        why = "blocked by SHARDSCALE_DISABLE_PLUGINS" if f["blocked"] else f"FAILED: {f['error']}"
        lines.append(f"- plugin {f['name']} ({f['distribution']}): {why}")
    lines.append(
        "- variables: " + (", ".join(f"{k}={v}" for k, v in env["variables"].items()) or "none set")
    )
    return "\n".join(lines)


def run_env(args: argparse.Namespace, *, stream: TextIO | None = None) -> int:
    """Print the environment (text or ``--json``); always exit status 0."""
    from shardscale.cli._plugin_timeout import load_plugins_with_limit

    out = stream if stream is not None else sys.stdout
    load_plugins_with_limit(args.plugin_timeout)
    env = collect_environment()
    if args.json:
        print(json.dumps(env, indent=2), file=out)
    else:
        print(format_environment(env), file=out)
    return 0
