"""``shardscale doctor``: check the environment a user is about to train in, and say what to fix.

Each check yields a :class:`Finding` with a status: ``ok``, ``info``, ``warn``
(works, but probably not what you want) or ``error`` (training will fail, or a
plugin was set aside). The command exits non-zero when any finding is an error.

It builds what a scaler would build here (backend chain from ``--backend`` or
``$SHARDSCALE_BACKEND`` or the automatic choice, adapters in their order,
kernels per device) and runs two scaler iterations in this process, so "nothing
is broken" means a scaler really stepped here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from shardscale.cli._floors import NCCL_FLOOR, TORCH_FLOOR, TRITON_FLOOR, below
from shardscale.cli._plugin_timeout import add_plugin_timeout_option, load_plugins_with_limit

if TYPE_CHECKING:
    import torch

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
    from shardscale.cli._cmdline import add_command, add_json_option

    p = add_command(
        sub,
        "doctor",
        help="check torch, CUDA/NCCL, the launch environment and plugins",
        description="Check the environment: torch version and build, CUDA and NCCL, the "
        "torchrun variables and process group (when launched under torchrun), and plugins "
        "that failed to load. Prints what to fix; exits 1 when something is broken. "
        "'shardscale env' prints the environment to paste into an issue (--json here holds "
        "it too).",
    )
    add_json_option(p, what="the findings and the environment")
    p.add_argument("--connect", action="store_true",
                   help="under torchrun: join the process group and all-reduce through the "
                   "shardscale backend to prove the ranks can talk")  # fmt: skip
    p.add_argument("--backend", default=None, metavar="SPEC",
                   help="collective backend spec to check (default: automatic)")  # fmt: skip
    add_plugin_timeout_option(p)
    p.set_defaults(func=run_doctor)
    return p


def _torch_checks() -> Iterator[Finding]:
    import torch

    from shardscale.core import ShardedGradScaler  # noqa: F401  (the import itself is a check)

    version = torch.__version__
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    if torch.version.hip:
        build = f"ROCm {torch.version.hip}"
    if below(version, TORCH_FLOOR):
        yield Finding("torch", "error", f"torch {version} ({build}) is older than {TORCH_FLOOR} "
                      "(the oldest tested)", f"pip install 'torch>={TORCH_FLOOR}'")  # fmt: skip
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
            if below(nccl, NCCL_FLOOR):
                yield Finding("nccl", "warn", f"NCCL {nccl} is older than {NCCL_FLOOR}, the NCCL "
                              f"of torch {TORCH_FLOOR}'s CUDA wheels (the oldest paired with "
                              "shardscale)", "use a torch build with a newer NCCL")  # fmt: skip
            else:
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


def _torch_triton_requirement() -> Any:
    """The ``triton`` requirement in the installed torch's metadata that applies here, or None.

    torch's CUDA wheels pin the Triton they were built with (``triton==3.6.0`` for
    torch 2.11.0); CPU builds require none. None also where ``packaging`` is missing.
    """
    import importlib.metadata as md

    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:
        return None
    try:
        raw = md.requires("torch") or []
    except md.PackageNotFoundError:  # torch imported from a source tree: no metadata
        return None
    for text in raw:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name == "triton" and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return req
    return None


def _triton_checks() -> Iterator[Finding]:
    """The installed Triton against shardscale-triton's floor and the Triton torch pins."""
    import importlib.metadata as md

    try:
        version = md.version("triton")
    except md.PackageNotFoundError:
        return  # without triton, the kernels finding says why shardscale-triton is unused
    try:
        ours: str | None = md.version("shardscale-triton")
    except md.PackageNotFoundError:
        ours = None
    req = _torch_triton_requirement()
    if ours is not None and below(version, TRITON_FLOOR):
        pin = f" (the one your torch requires: '{req}')" if req is not None else ""
        yield Finding("triton", "error", f"triton {version} is older than {TRITON_FLOOR}, the "
                      f"oldest shardscale-triton {ours} supports",
                      f"pip install 'triton>={TRITON_FLOOR}'{pin}")  # fmt: skip
    elif req is not None and not req.specifier.contains(version, prereleases=True):
        yield Finding("triton", "warn", f"triton {version} is not the Triton this torch was built "
                      f"with ('{req}'): torch.compile and the Triton kernels may fail",
                      f"pip install '{req}' (installing a newer Triton next to torch replaces "
                      "torch's own)")  # fmt: skip
    else:
        pinned = f"; torch requires '{req}'" if req is not None else ""
        yield Finding("triton", "ok", f"triton {version}{pinned}")


def _launch_checks(connect: bool) -> tuple[list[Finding], bool]:
    """The torchrun variables; returns the findings and whether this is a complete launch."""
    present = {k: os.environ[k] for k in _LAUNCH_VARS if k in os.environ}
    if not present:
        out = [Finding("launch", "info", "not launched by torchrun (no RANK/WORLD_SIZE); single "
                       "process. 'shardscale demo' starts several for you.")]  # fmt: skip
        if connect:
            out.append(Finding("process group", "warn", "--connect needs a torchrun launch",
                               "torchrun --nproc-per-node 2 -m shardscale.cli doctor --connect"))  # fmt: skip
        return out, False
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in present]
    if missing:
        return [Finding("launch", "error",
                        f"launch variables partly set: {', '.join(sorted(present))} but not {', '.join(missing)}",
                        "start with torchrun, which sets them all, or unset them")], False  # fmt: skip
    try:
        rank, world = int(present["RANK"]), int(present["WORLD_SIZE"])
        local = int(present.get("LOCAL_RANK", "0"))
        int(present["MASTER_PORT"])
    except ValueError as exc:
        return [Finding("launch", "error", f"a launch variable is not a number: {exc}",
                        "start with torchrun instead of setting the variables by hand")], False  # fmt: skip
    if not 0 <= rank < world:
        return [Finding("launch", "error", f"RANK={rank} is outside WORLD_SIZE={world}",
                        "every rank must be in [0, WORLD_SIZE)")], False  # fmt: skip
    elastic = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "a launcher"
    out = [Finding("launch", "ok", f"rank {rank} of {world} (local rank {local}) started by {elastic}; "
                   f"rendezvous {present['MASTER_ADDR']}:{present['MASTER_PORT']}")]  # fmt: skip
    import torch

    if torch.cuda.is_available() and local >= torch.cuda.device_count():
        out.append(Finding("launch", "error",
                           f"local rank {local} but only {torch.cuda.device_count()} GPU(s) here",
                           "use --nproc-per-node <= the number of GPUs"))  # fmt: skip
        return out, False
    return out, True


def _plugin_fix(exc: BaseException, source: str = "") -> str:
    """What to do about an error raised while building or running what a scaler builds."""
    from shardscale.core import (
        BackendUnavailableError,
        PluginConflictError,
        PluginNotFoundError,
    )

    if isinstance(exc, PluginConflictError):
        return ("two plugins provide the same thing: pick one explicitly as '<distribution>:<name>' "
                "or block one with SHARDSCALE_DISABLE_PLUGINS=<distribution> (see 'shardscale plugins')")  # fmt: skip
    if isinstance(exc, PluginNotFoundError) and source == "automatic choice":
        return ("name a backend with --backend or SHARDSCALE_BACKEND, or install (or unblock in "
                "SHARDSCALE_DISABLE_PLUGINS) the plugin that provides the automatic choice")  # fmt: skip
    if isinstance(exc, PluginNotFoundError):
        return ("fix the name in --backend/SHARDSCALE_BACKEND, or install (or unblock) the plugin "
                "that provides it; 'shardscale plugins' lists what is installed")  # fmt: skip
    if isinstance(exc, BackendUnavailableError):
        return "choose a backend that can run here ('shardscale plugins' says which can)"
    return ("see the message; 'shardscale plugins' shows what each plugin provides and what "
            "failed to load")  # fmt: skip


def _say(exc: BaseException) -> str:
    """shardscale's own errors in full (they name the problem and the fix); others in one line."""
    from shardscale.core import ShardscaleError

    return str(exc) if isinstance(exc, ShardscaleError) else _one_line(exc)


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _build_checks(spec: str, source: str) -> tuple[list[Finding], bool]:
    """Build what a scaler builds here: backend chain, adapters, kernels per device.

    Returns the findings and whether the backend chain could be built.
    """
    import torch

    from shardscale.core import get_registry

    reg = get_registry()
    out: list[Finding] = []
    built = True
    try:
        backend = reg.make_backend(spec, source=source)
        chain = []
        node: Any = backend
        while node is not None:
            chain.append(f"{getattr(node, 'name', '?')} ({type(node).__name__})")
            node = getattr(node, "inner", None)
        out.append(Finding("backend", "ok", f"{spec!r} from {source}: {' -> '.join(chain)}"))
    except Exception as exc:  # a plugin's constructor may raise anything
        built = False
        out.append(Finding("backend", "error", f"{spec!r} from {source} cannot be built: {_say(exc)}",
                           _plugin_fix(exc, source)))  # fmt: skip
    items = reg.items()
    adapters = [i for i in items if i.kind == "adapter"]
    if adapters:
        ranked = ", ".join(f"{i.name} ({i.priority}, {i.distribution})" for i in adapters)
        out.append(Finding("adapters", "ok", f"consulted in this order: {ranked}"))
    else:
        out.append(Finding("adapters", "error", "no grad adapter is registered: no step can run",
                           "install shardscale-core's plugin (unblock 'core' in "
                           "SHARDSCALE_DISABLE_PLUGINS) or another adapter plugin"))  # fmt: skip
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    for device in devices:
        try:
            k = reg.kernels_for(device)
            info = next((i for i in items if i.kind == "kernels" and i.name == k.name), None)
            where = f"{info.distribution}, priority {info.priority}" if info else "?"
            out.append(Finding(f"kernels ({device.type})", "ok", f"{k.name} ({where})"))
        except Exception as exc:
            out.append(Finding(f"kernels ({device.type})", "error", _say(exc), _plugin_fix(exc)))
    for i in items:
        if i.kind == "kernels" and not i.usable:
            out.append(Finding(f"kernels ({i.name})", "info",
                               f"{i.name} ({i.distribution}) is not used here: {i.reason}"))  # fmt: skip
    return out, built


def _scaler_step_check(spec: str, device: torch.device) -> Finding:
    """Two real scaler iterations: a finite gradient must step, an inf must skip and back off."""
    import torch

    from shardscale.core import ShardedGradScaler

    try:
        param = torch.nn.Parameter(torch.ones(4, device=device))
        opt = torch.optim.SGD([param], lr=1.0)
        scaler = ShardedGradScaler(device.type, backend=spec, init_scale=16.0)
        scaler.scale(param.sum()).backward()  # type: ignore[no-untyped-call]
        scaler.step(opt)
        scaler.update()
        stepped = bool(torch.equal(param.detach().cpu(), torch.zeros(4)))  # 1 - lr * grad 1
        opt.zero_grad()
        scaler.scale(param.sum() * float("inf")).backward()  # type: ignore[no-untyped-call]
        scaler.step(opt)
        scaler.update()
        skipped = bool(torch.equal(param.detach().cpu(), torch.zeros(4)))
        scale = scaler.get_scale()
    except Exception as exc:
        return Finding("scaler step", "error", f"a one-step check with backend {spec!r} on "
                       f"{device} failed: {_one_line(exc)}", _plugin_fix(exc))  # fmt: skip
    if not (stepped and skipped and scale == 8.0):
        return Finding("scaler step", "error",
                       f"a one-step check on {device} gave stepped={stepped}, skipped an inf "
                       f"gradient={skipped}, scale={scale} (expected True, True, 8.0)",
                       "a plugin in the backend chain or the kernels returns wrong values: try "
                       "another with --backend, or block plugins one by one")  # fmt: skip
    return Finding("scaler step", "ok", f"ShardedGradScaler on {device} with {spec!r}: a finite "
                   "step stepped, an inf step was skipped and the scale backed off")  # fmt: skip


def _step_device() -> torch.device:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _private_step_check(spec: str, *, needs_group: bool) -> Finding:
    """The step check in this process; in a private 1-rank gloo group when the chain needs one."""
    import torch.distributed as dist

    if not needs_group or dist.is_initialized() or not dist.is_gloo_available():
        return _scaler_step_check(spec, _step_device())
    # A group of one, on an in-memory store: no rendezvous, nothing reachable from outside.
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        return _scaler_step_check(spec, _step_device())
    finally:
        dist.destroy_process_group()


def _connect_check(spec: str, built: bool) -> list[Finding]:
    """Join the torchrun process group, all-reduce through the backend, then the step check."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from shardscale.core import ReduceOp, ShardscaleError, get_registry

    if not built:
        # The rendezvous is fine as far as we know: the plugin problem is reported above.
        return [Finding("process group", "error",
                        f"not attempted: the backend chain {spec!r} cannot be built (see 'backend')",
                        "fix the plugin problem above first; MASTER_ADDR/MASTER_PORT were not tried")]  # fmt: skip
    try:
        impl = get_registry().make_backend(spec)
    except Exception as exc:
        return [Finding("process group", "error", f"not attempted: the backend chain {spec!r} "
                        f"cannot be built: {_say(exc)}", _plugin_fix(exc))]  # fmt: skip
    use_cuda = torch.cuda.is_available()
    try:
        if not dist.is_initialized():
            if use_cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=60))
    except Exception as exc:
        return [Finding("process group", "error", f"could not join the process group: {_one_line(exc)}",
                        "check that every rank started and MASTER_ADDR:MASTER_PORT is reachable "
                        "from this host")]  # fmt: skip
    try:
        ones = torch.ones(1, device="cuda" if use_cuda else "cpu")
        try:
            impl.all_reduce(ones, op=ReduceOp.SUM, group=None).wait()
        except ShardscaleError as exc:
            return [Finding("process group", "error",
                            f"the backend chain {spec!r} refused to all-reduce: {_one_line(exc)}",
                            _plugin_fix(exc))]  # fmt: skip
        except Exception as exc:
            return [Finding("process group", "error", f"could not reduce across ranks: {_one_line(exc)}",
                            "check that every rank started and can reach the others")]  # fmt: skip
        world, got = dist.get_world_size(), int(ones.item())
        if got != world:
            return [Finding("process group", "error", f"all-reduce of ones gave {got}, expected {world}",
                            "a rank is using the wrong group or backend; run 'shardscale plugins'")]  # fmt: skip
        out = [
            Finding(
                "process group", "ok", f"{type(impl).__name__} all-reduced across {world} ranks"
            )
        ]
        out.append(_scaler_step_check(spec, _step_device()))
        return out
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _plugin_checks() -> Iterator[Finding]:
    from shardscale.core import get_registry
    from shardscale.core.plugins import DISABLE_ENV

    reg = get_registry()
    items = reg.items()
    failures = reg.failures()
    blocked = [f for f in failures if f.blocked]
    for failure in failures:
        if failure.blocked:
            continue
        yield Finding("plugins", "error",
                      f"{failure.name} ({failure.distribution} {failure.version}) was set aside "
                      f"[{failure.stage}]: {failure.error}", failure.fix)  # fmt: skip
    if blocked:
        gone = ", ".join(f"{f.name} ({f.distribution})" for f in blocked)
        remains = "; ".join(
            f"{label}: {', '.join(sorted({i.name for i in items if i.kind == kind})) or '(none)'}"
            for kind, label in (
                ("backend", "backends"),
                ("middleware", "middleware"),
                ("adapter", "adapters"),
                ("kernels", "kernels"),
            )
        )
        yield Finding("plugins", "info", f"blocked by {DISABLE_ENV} (not imported): {gone}. "
                      f"What remains: {remains}")  # fmt: skip
    unmatched = reg.unmatched_disable_names()
    if unmatched:
        known = sorted({p.name for p in reg.plugins()} | {p.distribution for p in reg.plugins()})
        yield Finding("plugins", "warn",
                      f"{DISABLE_ENV} names {', '.join(map(repr, unmatched))}, which match no "
                      "installed plugin, so they block nothing",
                      f"check the spelling; installed names: {', '.join(known)}")  # fmt: skip
    by_name: dict[tuple[str, str], list[str]] = {}
    for i in items:
        by_name.setdefault((i.kind, i.name), []).append(f"{i.distribution} (plugin {i.plugin!r})")
    for (kind, name), owners in sorted(by_name.items()):
        if len(owners) > 1:
            yield Finding("plugins", "error",
                          f"the {kind} name {name!r} is provided by {' and '.join(owners)}: "
                          "asking for it by name fails",
                          f"uninstall or block one (SHARDSCALE_DISABLE_PLUGINS=<distribution>), or "
                          f"always qualify it as '<distribution>:{name}'")  # fmt: skip
    for kind in ("adapter", "kernels"):
        by_priority: dict[int, list[str]] = {}
        for i in items:
            if i.kind == kind and i.priority is not None:
                by_priority.setdefault(i.priority, []).append(f"{i.name} ({i.distribution})")
        for priority, names in sorted(by_priority.items()):
            if len(names) > 1:
                yield Finding("plugins", "warn",
                              f"{kind} {' and '.join(names)} share priority {priority}: where both "
                              "apply to one parameter or device, the lookup is an error",
                              "block one, or ask their authors for distinct priorities")  # fmt: skip
    usable = sorted(f"{i.kind}:{i.name}" for i in items if i.usable)
    yield Finding("plugins", "ok", f"{len(usable)} usable: {', '.join(usable)}")
    # shardscale-clip registers no plugin (its kernels are core's built-ins): not listed here.
    for dist_name, what in (("shardscale-collectives", "c10d backend"),
                            ("shardscale-fsdp", "FSDP/DTensor adapters")):  # fmt: skip
        if not any(i.distribution == dist_name for i in items) and not any(
            f.distribution == dist_name for f in failures
        ):
            yield Finding(dist_name, "warn",
                          f"{dist_name} registers no plugins here ({what})",
                          f"pip install {dist_name}")  # fmt: skip


_T = TypeVar("_T")


def _guarded(check: str, run: Callable[[], _T], empty: _T, crashes: list[Finding]) -> _T:
    """Run one group of checks; a crash of doctor itself becomes a finding, not a traceback."""
    try:
        return run()
    except Exception as exc:
        crashes.append(Finding(check, "error", f"this check itself failed: {_one_line(exc)}",
                               "please report it with the output of 'shardscale doctor --json'"))  # fmt: skip
        return empty


# Trainer integrations: (distribution, the framework it adapts). Checked only when installed.
_INTEGRATIONS = (("shardscale-lightning", "lightning"), ("shardscale-accelerate", "accelerate"),
                 ("shardscale-transformers", "transformers"), ("shardscale-verl", "verl"),
                 ("shardscale-rlinf", "rlinf"))  # fmt: skip
# Integrations that run without their framework (a drop-in with its signature): (dist, framework).
_OPTIONAL_FRAMEWORK = (("shardscale-torchtitan", "torchtitan"),)


def _integration_checks() -> Iterator[Finding]:
    import importlib.metadata as md

    for dist_name, framework in _INTEGRATIONS + _OPTIONAL_FRAMEWORK:
        try:
            version = md.version(dist_name)
        except md.PackageNotFoundError:
            continue
        try:
            framework_version = md.version(framework)
        except md.PackageNotFoundError:
            if (dist_name, framework) in _OPTIONAL_FRAMEWORK:
                yield Finding(dist_name, "info", f"{dist_name} {version}: {framework} is not "
                              "installed (not needed: the drop-in does not import it)")  # fmt: skip
                continue
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
    """Every check, in order.

    The backend chain, adapters and kernels are built exactly as a scaler
    would build them in this environment (``--backend``, else
    ``$SHARDSCALE_BACKEND``, else the automatic choice as under this launch),
    and two scaler iterations run in-process; plugin failures recorded along
    the way (an adapter's ``claims()`` that raises, say) are reported last.
    """
    import warnings

    from shardscale.core import PluginWarning, ShardscaleError, get_registry

    crashes: list[Finding] = []
    findings = list(_torch_checks())
    findings += _guarded("triton", lambda: list(_triton_checks()), [], crashes)
    launch, launched = _launch_checks(connect)
    with warnings.catch_warnings():
        # Every plugin warning becomes a finding below; do not print it twice.
        warnings.simplefilter("ignore", PluginWarning)
        try:
            spec, source = get_registry().backend_spec(backend, distributed=launched)
        except ShardscaleError as exc:
            findings.append(Finding("backend", "error", f"no backend can be chosen: {exc}",
                                    _plugin_fix(exc)))  # fmt: skip
            spec, source = "", ""
        built = False
        if spec:
            nothing: tuple[list[Finding], bool] = ([], False)
            build, built = _guarded("build", lambda: _build_checks(spec, source), nothing, crashes)
            findings += build
        findings += launch
        if connect and launched:
            findings += _guarded("process group", lambda: _connect_check(spec, built), [], crashes)
        elif built:
            needs_group = source != "automatic choice" or launched
            findings += _guarded(
                "scaler step",
                lambda: [_private_step_check(spec, needs_group=needs_group)],
                [],
                crashes,
            )
        findings += _guarded("plugins", lambda: list(_plugin_checks()), [], crashes)
        findings += _guarded("integrations", lambda: list(_integration_checks()), [], crashes)
    findings += crashes
    return findings


_MARK = {"ok": "ok", "info": "--", "warn": "!!", "error": "XX"}
#: Each status's colour on a terminal (see ``print_table``'s ``styles``).
_STYLE = {"ok": "green", "info": "dim", "warn": "yellow", "error": "red"}


def run_doctor(args: argparse.Namespace, *, stream: TextIO | None = None) -> int:
    """Print the findings; exit status 1 when any is an error."""
    from shardscale.cli._ui import print_table

    out = stream if stream is not None else sys.stdout
    load_plugins_with_limit(args.plugin_timeout)
    findings = run_checks(connect=args.connect, backend=args.backend)
    broken = any(f.status == "error" for f in findings)
    if args.json:
        from shardscale.cli._env import collect_environment

        data = {
            "ok": not broken,
            "findings": [asdict(f) for f in findings],
            "environment": collect_environment(),
        }
        print(json.dumps(data, indent=2), file=out)
        return 1 if broken else 0
    rows = [(f"[{_MARK[f.status]}] {f.check}", f.detail) for f in findings]
    styles = [_STYLE[f.status] for f in findings]
    print_table("shardscale doctor", rows, headers=("check", "finding"), stream=out, styles=styles)
    fixes = [f for f in findings if f.fix and f.status in ("warn", "error")]
    if fixes:
        print("\nwhat to fix:", file=out)
        for f in fixes:
            print(f"  - {f.check}: {f.fix}", file=out)
    print("\n" + ("something is broken: see above" if broken else "nothing is broken"), file=out)
    return 1 if broken else 0
