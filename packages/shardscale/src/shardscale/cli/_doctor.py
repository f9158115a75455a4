"""``shardscale doctor``: check the environment a user is about to train in, and say what to fix.

Each check yields a :class:`Finding` with a status: ``ok``, ``info``, ``warn``
(works, but probably not what you want) or ``error`` (training will fail).
The command exits non-zero when any finding is an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, TextIO

__all__ = ["Finding", "add_doctor_parser", "run_checks", "run_doctor"]

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Finding:
    """One check's outcome; ``fix`` says what to do when the status is warn or error."""

    check: str
    status: str
    detail: str
    fix: str = ""


def add_doctor_parser(sub: Any) -> argparse.ArgumentParser:
    """Register the ``doctor`` subcommand."""
    p: argparse.ArgumentParser = sub.add_parser(
        "doctor",
        help="check torch, CUDA/NCCL, the launch environment and plugins",
        description="Check the environment: torch version and build, CUDA and NCCL, the "
        "torchrun variables and process group (when launched under torchrun), and plugins "
        "that failed to load. Prints what to fix; exits 1 when something is broken.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--connect", action="store_true",
                   help="under torchrun: join the process group and all-reduce through the "
                   "shardscale backend to prove the ranks can talk")  # fmt: skip
    p.add_argument("--backend", default=None, metavar="SPEC",
                   help="collective backend spec to check (default: automatic)")  # fmt: skip
    p.set_defaults(func=run_doctor)
    return p


def _torch_checks() -> Iterator[Finding]:
    import torch

    from shardscale.core import ShardedGradScaler  # noqa: F401  (the import itself is a check)

    version = torch.__version__
    base = tuple(int(x) for x in version.split("+")[0].split(".")[:2] if x.isdigit())
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    if torch.version.hip:
        build = f"ROCm {torch.version.hip}"
    if base < (2, 13):
        yield Finding("torch", "error", f"torch {version} ({build}) is older than 2.13 (the oldest tested)",
                      "pip install 'torch>=2.13'")  # fmt: skip
    else:
        yield Finding("torch", "ok", f"torch {version} ({build})")
    import torch.distributed as dist

    if not dist.is_available():
        yield Finding("torch.distributed", "error", "this torch build has no torch.distributed",
                      "install a torch build with distributed support (the PyPI wheels have it)")  # fmt: skip
        return
    yield Finding("gloo", "ok" if dist.is_gloo_available() else "warn",
                  "gloo available (CPU collectives)" if dist.is_gloo_available() else
                  "gloo not available: CPU runs cannot communicate",
                  "" if dist.is_gloo_available() else "install a torch build with gloo")  # fmt: skip
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        yield Finding("cuda", "ok", f"{torch.cuda.device_count()} GPU(s): {names}")
        if dist.is_nccl_available():
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
            yield Finding("nccl", "ok", f"NCCL {nccl}")
        else:
            yield Finding("nccl", "error", "CUDA is available but NCCL is not",
                          "install a CUDA build of torch with NCCL (the PyPI CUDA wheels have it)")  # fmt: skip
    elif torch.version.cuda:
        yield Finding("cuda", "warn", f"torch is built for CUDA {torch.version.cuda} but sees no GPU",
                      "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES; or train on CPU")  # fmt: skip
    else:
        yield Finding("cuda", "info", "no CUDA: CPU-only torch; training runs on CPU with gloo",
                      "for GPUs install a CUDA build of torch")  # fmt: skip


def _launch_checks(connect: bool, backend: str | None) -> Iterator[Finding]:
    present = {k: os.environ[k] for k in _LAUNCH_VARS if k in os.environ}
    if not present:
        yield Finding("launch", "info", "not launched by torchrun (no RANK/WORLD_SIZE); single "
                      "process. 'shardscale demo' starts several for you.")  # fmt: skip
        if connect:
            yield Finding("process group", "warn", "--connect needs a torchrun launch",
                          "torchrun --nproc-per-node 2 -m shardscale.cli doctor --connect")  # fmt: skip
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in present]
    if missing:
        yield Finding("launch", "error",
                      f"launch variables partly set: {', '.join(sorted(present))} but not {', '.join(missing)}",
                      "start with torchrun, which sets them all, or unset them")  # fmt: skip
        return
    try:
        rank, world = int(present["RANK"]), int(present["WORLD_SIZE"])
        local = int(present.get("LOCAL_RANK", "0"))
        int(present["MASTER_PORT"])
    except ValueError as exc:
        yield Finding("launch", "error", f"a launch variable is not a number: {exc}",
                      "start with torchrun instead of setting the variables by hand")  # fmt: skip
        return
    if not 0 <= rank < world:
        yield Finding("launch", "error", f"RANK={rank} is outside WORLD_SIZE={world}",
                      "every rank must be in [0, WORLD_SIZE)")  # fmt: skip
        return
    elastic = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "a launcher"
    yield Finding("launch", "ok", f"rank {rank} of {world} (local rank {local}) started by {elastic}; "
                  f"rendezvous {present['MASTER_ADDR']}:{present['MASTER_PORT']}")  # fmt: skip
    import torch

    if torch.cuda.is_available() and local >= torch.cuda.device_count():
        yield Finding("launch", "error",
                      f"local rank {local} but only {torch.cuda.device_count()} GPU(s) here",
                      "use --nproc-per-node <= the number of GPUs")  # fmt: skip
    if connect:
        yield _connect_check(backend)


def _connect_check(backend: str | None) -> Finding:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from shardscale.core import ReduceOp, get_registry

    use_cuda = torch.cuda.is_available()
    try:
        if not dist.is_initialized():
            if use_cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=60))
        impl = get_registry().make_backend(backend)
        ones = torch.ones(1, device="cuda" if use_cuda else "cpu")
        impl.all_reduce(ones, op=ReduceOp.SUM, group=None).wait()
        world = dist.get_world_size()
        got = int(ones.item())
    except Exception as exc:
        return Finding("process group", "error", f"could not reduce across ranks: {exc}",
                       "check that every rank started and MASTER_ADDR/port are reachable")  # fmt: skip
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if got != world:
        return Finding("process group", "error", f"all-reduce of ones gave {got}, expected {world}",
                       "a rank is using the wrong group or backend; run 'shardscale plugins'")  # fmt: skip
    return Finding("process group", "ok",
                   f"{type(impl).__name__} all-reduced across {world} ranks")  # fmt: skip


def _plugin_checks(backend: str | None) -> Iterator[Finding]:
    from shardscale.core import ShardscaleError, get_registry

    try:
        reg = get_registry()
        items = reg.items()
    except ShardscaleError as exc:
        yield Finding(
            "plugins", "error", str(exc), "see the message: uninstall or block one plugin"
        )
        return
    for failure in reg.failures():
        if failure.blocked:
            yield Finding("plugins", "info", f"{failure.name} ({failure.distribution}) is blocked "
                          "by SHARDSCALE_DISABLE_PLUGINS")  # fmt: skip
        else:
            yield Finding("plugins", "error",
                          f"{failure.name} ({failure.distribution} {failure.version}) failed to "
                          f"load: {failure.error}",
                          f"reinstall it (pip install --force-reinstall {failure.distribution}) "
                          f"or block it with SHARDSCALE_DISABLE_PLUGINS={failure.name}")  # fmt: skip
    usable = sorted(f"{i.kind}:{i.name}" for i in items if i.usable)
    yield Finding("plugins", "ok", f"{len(usable)} usable: {', '.join(usable)}")
    for dist_name, what in (("shardscale-collectives", "c10d backend"),
                            ("shardscale-clip", "unscale_and_clip_"),
                            ("shardscale-fsdp", "FSDP/DTensor adapters")):  # fmt: skip
        if not any(i.distribution == dist_name for i in items) and not any(
            f.distribution == dist_name for f in reg.failures()
        ):
            yield Finding(dist_name, "warn" if dist_name != "shardscale-clip" else "info",
                          f"{dist_name} registers no plugins here ({what})",
                          f"pip install {dist_name}")  # fmt: skip
    if backend is not None:
        try:
            reg.make_backend(backend)
            yield Finding("backend", "ok", f"backend spec {backend!r} can be built here")
        except ShardscaleError as exc:
            yield Finding(
                "backend", "error", str(exc), "pick a usable name from 'shardscale plugins'"
            )


# Trainer integrations: (distribution, the framework it adapts). Checked only when installed.
_INTEGRATIONS = (("shardscale-lightning", "lightning"), ("shardscale-accelerate", "accelerate"))


def _integration_checks() -> Iterator[Finding]:
    import importlib.metadata as md

    for dist_name, framework in _INTEGRATIONS:
        try:
            version = md.version(dist_name)
        except md.PackageNotFoundError:
            continue
        try:
            framework_version = md.version(framework)
        except md.PackageNotFoundError:
            yield Finding(dist_name, "error", f"{dist_name} {version} is installed but "
                          f"{framework} is not", f"pip install {dist_name} (it requires {framework})")  # fmt: skip
            continue
        try:  # packaging comes with both frameworks; without it, only the versions are shown
            from packaging.requirements import Requirement
        except ImportError:
            specs = []
        else:
            specs = [
                req.specifier
                for raw in md.requires(dist_name) or []
                if (req := Requirement(raw)).name == framework
            ]
        if specs and framework_version not in specs[0]:
            yield Finding(dist_name, "warn", f"{framework} {framework_version} is outside the "
                          f"range {dist_name} {version} was tested with ({specs[0]})",
                          f"pip install '{framework}{specs[0]}'")  # fmt: skip
            continue
        yield Finding(
            dist_name, "ok", f"{dist_name} {version} with {framework} {framework_version}"
        )


def run_checks(*, connect: bool = False, backend: str | None = None) -> list[Finding]:
    """Every check, in order."""
    findings = list(_torch_checks())
    findings += list(_plugin_checks(backend))
    findings += list(_integration_checks())
    findings += list(_launch_checks(connect, backend))
    return findings


_MARK = {"ok": "ok", "info": "--", "warn": "!!", "error": "XX"}


def run_doctor(args: argparse.Namespace, *, stream: TextIO | None = None) -> int:
    """Print the findings; exit status 1 when any is an error."""
    from shardscale.cli._ui import print_table

    out = stream if stream is not None else sys.stdout
    findings = run_checks(connect=args.connect, backend=args.backend)
    broken = any(f.status == "error" for f in findings)
    if args.json:
        print(json.dumps({"ok": not broken, "findings": [asdict(f) for f in findings]}, indent=2),
              file=out)  # fmt: skip
        return 1 if broken else 0
    rows = [(f"[{_MARK[f.status]}] {f.check}", f.detail) for f in findings]
    print_table("shardscale doctor", rows, headers=("check", "finding"), stream=out)
    fixes = [f for f in findings if f.fix and f.status in ("warn", "error")]
    if fixes:
        print("\nwhat to fix:", file=out)
        for f in fixes:
            print(f"  - {f.check}: {f.fix}", file=out)
    print("\n" + ("something is broken: see above" if broken else "nothing is broken"), file=out)
    return 1 if broken else 0
