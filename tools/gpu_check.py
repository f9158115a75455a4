"""The GPU check in two commands that fit one rented GPU lease, with the machine's own torch.

A lease is 15 minutes in all (start-up included) and at most 10 minutes a
command, on a machine without network whose image has Python, torch, Triton,
pytest, hypothesis and pluggy but not hatchling. So the check is two commands
of at most 5 minutes each (``--budget``, 290 s by default), run from a clone
with our wheels beside it (``nox -s gpu_wheelhouse`` builds
``.nox/gpu-wheelhouse``, about 3 MiB; bring it along)::

    python tools/gpu_check.py tests --report OUT/gpu-check.md   # 1: install, doctor, tests
    python tools/gpu_check.py bench --report OUT/gpu-check.md   # 2: the step-tail benchmark

Each command runs its parts in order of value, each within its own time
limit (``LIMITS``); a part that runs out of time is reported as such and the
next one starts. ``tests``:

1. **environment**: Python, torch (build, CUDA, GPUs), NCCL and Triton,
   judged against shardscale's floors (``shardscale/cli/_floors.py``);
2. **install**: our wheels from ``--wheelhouse`` with ``pip --no-index
   --no-deps --target`` into a folder of their own (``.nox/gpu-site``, put on
   ``PYTHONPATH`` of every part), and the pure-Python test dependencies found
   there when this Python lacks them. pip never looks at an index and never
   touches the machine's packages (an image's Python may be externally
   managed); nothing is built, so hatchling is not needed;
3. **doctor**: ``shardscale doctor --json``;
4. **cuda tests**: ``pytest -m gpu`` over the test files with CUDA cases;
5. **triton tests**: shardscale-triton's tests, compiled on the GPU (launch
   counts, ``set_sync_debug_mode("error")``).

``bench`` (environment and install again, seconds, so it also runs on a
fresh machine):

6. **bench (8.4M)** and 7. **bench (33.6M)**: ``shardscale bench --device
   cuda --amp fp16`` on the memory table's two models: torch's recipe vs ours
   (the device's kernels, and ``foreach``), fp16 autocast, with launches per
   step (CUDA kernels, profiler) and host syncs (``set_sync_debug_mode``);
   ``--quick-bench``: the smoke-sized model.

Each command writes the one Markdown report (``--report``): the parts of
this command and those the other command left in ``.nox/gpu-check/parts.json``
on this machine, so the second command's report has both. It prints every part
it skipped and why, and exits 1 when a part failed, else 0. Without CUDA the
CUDA parts are skipped with the reason (``nox -s gpu_dry_run`` does that on a
CPU, from the wheelhouse). ``--only PART`` / ``--skip PART`` pick parts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
FLOORS = runpy.run_path(str(ROOT / "packages/shardscale/src/shardscale/cli/_floors.py"))
# Ours, without the trainer integrations (they need lightning/accelerate, not part of this).
DISTS = ["shardscale-core", "shardscale-collectives", "shardscale-clip", "shardscale-fsdp",
         "shardscale-triton", "shardscale-telemetry", "shardscale-schedules",
         "shardscale"]  # fmt: skip
TEST_DEPS = ["pytest", "pytest-timeout", "hypothesis", "pluggy"]
TRITON_TESTS = ROOT / "packages" / "shardscale-triton" / "tests"
#: The parts of each command, in the order they run (their order of value).
COMMANDS = {
    "tests": ["environment", "install", "doctor", "cuda tests", "triton tests"],
    "bench": ["environment", "install", "bench (8.4M)", "bench (33.6M)"],
}
PARTS = [*COMMANDS["tests"], "bench (8.4M)", "bench (33.6M)"]
#: Seconds each part may take at most (the command's budget may leave less). Each command's
#: parts add up to at most its default budget, so every part gets its whole limit.
LIMITS = {"environment": 40, "install": 40, "doctor": 50, "cuda tests": 100,
          "triton tests": 60, "bench (8.4M)": 90, "bench (33.6M)": 120}  # fmt: skip
#: Each command's default budget: under the 5 minutes a command may take, start-up included.
BUDGET_S = 290.0
#: Where our wheels are installed (``pip --target``) and where each command leaves its parts.
SITE = ROOT / ".nox" / "gpu-site"
STATE = ROOT / ".nox" / "gpu-check" / "parts.json"
# The memory table's two models (docs/benchmark.md): width and hidden size of the four blocks.
BENCH_MODELS = {"bench (8.4M)": ("512", "2048"), "bench (33.6M)": ("1024", "4096")}

# What the machine has: run in a child so that this process imports nothing of it.
_PROBE = r"""
import importlib.metadata as md, json, platform, re, sys
out = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
else:
    out["torch"] = torch.__version__
    out["cuda_build"] = torch.version.cuda
    out["cuda"] = torch.cuda.is_available()
    out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if out["cuda"] else []
    out["capability"] = list(torch.cuda.get_device_capability(0)) if out["cuda"] else None
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else None
    except Exception as exc:
        out["nccl"] = None
        out["nccl_error"] = f"{type(exc).__name__}: {exc}"
    try:
        pins = [r for r in md.requires("torch") or [] if re.match(r"triton\b", r)]
    except md.PackageNotFoundError:
        pins = []
    out["torch_triton_pin"] = pins[0].split(";")[0].strip() if pins else None
for name in ("triton", "numpy", "shardscale-core"):
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""


@dataclass
class Part:
    """One part's outcome: ``ok``, ``failed`` or ``skipped``, and why."""

    name: str
    status: str
    detail: str
    seconds: float = 0.0
    output: str = ""


class Run:
    """The parts done so far, the time left, and how to run a child process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.python = args.python
        self.parts: list[Part] = []
        self.start = time.monotonic()
        self.env: dict[str, Any] = {}
        #: The folder our wheels went into (None: test what this Python already has).
        self.site: Path | None = None if args.no_install else Path(args.site)
        #: The time limit of the last child (for "ran out of its N s").
        self.limit = 0.0

    def left(self) -> float:
        budget = float(self.args.budget) * self.args.time_scale
        return budget - (time.monotonic() - self.start)

    def add(self, part: Part) -> Part:
        self.parts.append(part)
        mark = {"ok": "ok  ", "failed": "FAIL", "skipped": "skip"}[part.status]
        print(f"[{mark}] {part.name} ({part.seconds:.0f} s): {part.detail}", flush=True)
        return part

    def ran_out(self) -> str:
        """The detail of a part stopped at its time limit."""
        return f"ran out of time: stopped at its {self.limit:.0f} s limit"

    def skip(self, name: str, reason: str) -> Part:
        return self.add(Part(name, "skipped", reason))

    def child(
        self, name: str, argv: list[str], *, env: dict[str, str] | None = None
    ) -> tuple[int | None, str, float]:
        """Run ``argv`` within the part's limit; (exit status or None on timeout, output, s)."""
        limit = self.limit = max(1.0, min(LIMITS[name] * self.args.time_scale, self.left()))
        full_env = {**os.environ, **(env or {})}
        full_env.pop("TRITON_INTERPRET", None)  # compiled kernels only, here
        if self.site is not None:  # our wheels, installed apart from the machine's packages
            path = full_env.get("PYTHONPATH")
            full_env["PYTHONPATH"] = str(self.site) + (os.pathsep + path if path else "")
        t0 = time.monotonic()
        try:
            proc = subprocess.run(argv, cwd=ROOT, env=full_env, capture_output=True, text=True,
                                  timeout=limit, check=False)  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            parts = [p.decode(errors="replace") if isinstance(p, bytes) else p or ""
                     for p in (exc.stdout, exc.stderr)]  # fmt: skip
            return None, "".join(parts) + f"\n(stopped after {limit:.0f} s)", time.monotonic() - t0
        return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _below(version: str, floor: str) -> bool:
    below = FLOORS["below"]
    return bool(below(version, floor))


def check_environment(run: Run) -> Part:
    code, out, secs = run.child("environment", [run.python, "-c", _PROBE])
    if code != 0:
        why = run.ran_out() if code is None else f"cannot inspect {run.python}"
        return run.add(Part("environment", "failed", why,
                            secs, _tail(out)))  # fmt: skip
    # The probe's JSON is its last line on stdout; stderr (merged here) may carry warnings,
    # e.g. torch's "Failed to initialize NumPy" where numpy is not installed.
    found = [ln for ln in out.splitlines() if ln.startswith("{")]
    if not found:
        return run.add(Part("environment", "failed", "the probe printed no JSON", secs,
                            _tail(out)))  # fmt: skip
    env = run.env = json.loads(found[-1])
    if "torch_error" in env:
        return run.add(Part("environment", "failed", f"torch does not import: {env['torch_error']}",
                            secs))  # fmt: skip
    problems = []
    if _below(env["torch"], FLOORS["TORCH_FLOOR"]):
        problems.append(f"torch {env['torch']} is older than {FLOORS['TORCH_FLOOR']}")
    if env["triton"] and _below(env["triton"], FLOORS["TRITON_FLOOR"]):
        problems.append(f"triton {env['triton']} is older than {FLOORS['TRITON_FLOOR']} "
                        "(shardscale-triton's floor)")  # fmt: skip
    notes = []
    if env.get("nccl") and _below(env["nccl"], FLOORS["NCCL_FLOOR"]):
        notes.append(f"NCCL {env['nccl']} is older than {FLOORS['NCCL_FLOOR']} (the NCCL of "
                     f"torch {FLOORS['TORCH_FLOOR']}'s CUDA wheels): untested")  # fmt: skip
    pin = env.get("torch_triton_pin")
    if pin and env["triton"] and env["triton"] not in pin:
        notes.append(f"torch requires {pin}, triton {env['triton']} is installed")
    build = f"CUDA {env['cuda_build']}" if env["cuda_build"] else "CPU-only build"
    gpus = ", ".join(env["gpus"]) or "no GPU visible"
    cap = f" (sm_{env['capability'][0]}{env['capability'][1]})" if env["capability"] else ""
    detail = (f"Python {env['python']}, torch {env['torch']} ({build}), {gpus}{cap}, "
              f"NCCL {env.get('nccl') or 'none'}, triton {env['triton'] or 'not installed'}"
              f"{f' (torch requires {pin})' if pin else ''}; floors: torch "
              f">={FLOORS['TORCH_FLOOR']}, triton >={FLOORS['TRITON_FLOOR']}, NCCL "
              f">={FLOORS['NCCL_FLOOR']}")  # fmt: skip
    if notes:
        detail += "; note: " + "; ".join(notes)
    if problems:
        return run.add(Part("environment", "failed", "; ".join(problems) + " -- " + detail, secs))
    return run.add(Part("environment", "ok", detail, secs))


def install(run: Run) -> Part:
    if run.args.no_install:
        return run.skip("install", "--no-install: testing the shardscale already installed here")
    house = Path(run.args.wheelhouse)
    wheels = []
    for dist in DISTS:
        found = sorted(house.glob(f"{dist.replace('-', '_')}-*.whl"))
        if not found:
            return run.add(Part("install", "failed", f"no {dist} wheel in {house}: build the "
                                "folder with 'nox -s gpu_wheelhouse' where there is network and "
                                "bring it along (or pass --no-install)"))  # fmt: skip
        wheels.append(str(found[-1]))
    site = Path(run.args.site)
    shutil.rmtree(site, ignore_errors=True)  # this run's wheels only, never an older run's
    site_now, run.site = run.site, None  # pip itself runs with the machine's packages only
    pip = [run.python, "-m", "pip", "install", "--no-index", "--find-links", str(house),
           "--target", str(site), "--disable-pip-version-check"]  # fmt: skip
    # Ours with --no-deps: torch, Triton and everything else of the machine stay as they are.
    code, out, secs = run.child("install", [*pip, "--no-deps", *wheels])
    if code != 0:
        run.site = site_now
        why = run.ran_out() if code is None else "pip could not install our wheels"
        return run.add(Part("install", "failed", why, secs, _tail(out)))
    missing = [d for d in TEST_DEPS if not _has(run, d)]
    if missing:
        # Only what is missing, from the folder alone (their own requirements come from it too).
        code, more, extra = run.child("install", [*pip, *missing])
        secs += extra
        if code != 0:
            run.site = site_now
            return run.add(Part("install", "failed", f"pip could not install {missing} from "
                                f"{house}", secs, _tail(more)))  # fmt: skip
    run.site = site_now
    return run.add(Part("install", "ok", f"{len(wheels)} wheels with --no-deps from {house} "
                        f"into {site}" + (f"; test dependencies {', '.join(missing)}" if missing
                                          else ""), secs))  # fmt: skip


def _has(run: Run, dist: str) -> bool:
    code, _, _ = run.child("install", [run.python, "-c",
                                       f"import importlib.metadata as m; m.version({dist!r})"])  # fmt: skip
    return code == 0


def doctor(run: Run) -> Part:
    code, out, secs = run.child("doctor", [run.python, "-m", "shardscale.cli", "doctor", "--json"])
    try:
        # The JSON, whatever stderr (merged here) printed after it (warnings of torch or numpy).
        data, _ = json.JSONDecoder().raw_decode(out, out.index("{"))
    except ValueError:
        return run.add(Part("doctor", "failed", "shardscale doctor printed no JSON", secs,
                            _tail(out)))  # fmt: skip
    rows = [f"{f['status']:5} {f['check']}: {f['detail']}" for f in data["findings"]]
    bad = [f"{f['check']}: {f['detail']}" for f in data["findings"] if f["status"] == "error"]
    if code != 0 or bad:
        return run.add(Part("doctor", "failed", "; ".join(bad) or f"exit status {code}", secs,
                            "\n".join(rows)))  # fmt: skip
    warns = sum(f["status"] == "warn" for f in data["findings"])
    return run.add(Part("doctor", "ok", f"nothing is broken ({len(rows)} findings, {warns} "
                        "warnings)", secs, "\n".join(rows)))  # fmt: skip


def _gpu_test_files() -> list[str]:
    """The test files with CUDA cases (``pytest.mark.gpu``), shardscale-triton's left out."""
    roots = [*sorted((ROOT / "packages").glob("*/tests")), ROOT / "integration_tests"]
    files = []
    for folder in roots:
        if folder == TRITON_TESTS:
            continue
        for path in sorted(folder.glob("test_*.py")):
            if "mark.gpu" in path.read_text(encoding="utf-8"):
                files.append(str(path.relative_to(ROOT)))
    return files


def _pytest(run: Run, name: str, paths: list[str]) -> Part:
    argv = [run.python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *paths]
    code, out, secs = run.child(name, argv)
    summary = next((ln for ln in reversed(out.strip().splitlines()) if " in " in ln), "")
    summary = summary.strip("= ")
    if code == 0:
        return run.add(Part(name, "ok", f"{summary} ({len(paths)} files)", secs, _tail(out, 15)))
    if code == 5:
        return run.add(Part(name, "failed", "no CUDA test was collected", secs, _tail(out)))
    why = run.ran_out() if code is None else summary or f"exit status {code}"
    return run.add(Part(name, "failed", why, secs, _tail(out, 60)))


def _no_cuda(run: Run) -> str | None:
    env = run.env
    if not env or "torch" not in env:
        return "torch could not be inspected (see environment)"
    if not env["cuda"]:
        build = f"torch {env['torch']} is built for CUDA {env['cuda_build']} but sees no GPU" if (
            env["cuda_build"]) else f"torch {env['torch']} is a CPU-only build"  # fmt: skip
        return f"no CUDA device (torch.cuda.is_available() is False: {build})"
    return None


def _no_triton(run: Run) -> str | None:
    return _no_cuda(run) or (None if run.env.get("triton") else "triton is not installed here")


def bench_argv(run: Run, name: str, folder: Path) -> list[str]:
    """``shardscale bench --device cuda --amp fp16`` for one model of the memory table (one rank
    per GPU, at most two: FSDP over both, and FSDP x TP)."""
    world = 2 if len(run.env.get("gpus", [])) >= 2 else 1
    meshes = "dp2,dp1xtp2" if world == 2 else "dp1"
    size = (["--quick"] if run.args.quick_bench else
            ["--width", BENCH_MODELS[name][0], "--hidden", BENCH_MODELS[name][1]])  # fmt: skip
    return [run.python, "-m", "shardscale.cli", "bench", "--device", "cuda", "--amp", "fp16",
            *size, "--world-size", str(world), "--meshes", meshes, "--scaling-points", "none",
            "--out", str(folder)]  # fmt: skip


def bench(run: Run, name: str, out_dir: Path) -> Part:
    folder = out_dir / name.replace(" ", "-").strip("()")
    argv = bench_argv(run, name, folder)
    code, out, secs = run.child(name, argv)
    table = folder / "bench.md"
    if code != 0 or not table.exists():
        return run.add(Part(name, "failed", run.ran_out() if code is None else f"exit status {code}",
                            secs, _tail(out, 40)))  # fmt: skip
    world = argv[argv.index("--world-size") + 1]
    data = json.loads((folder / "bench.json").read_text(encoding="utf-8"))
    # ours' unscale + clip must never sync the host (torch's recipe and an unfused step may).
    synced = [f"{row['mesh']} {row['optimizer']} {arm}" for row in data.get("rows", [])
              for arm, rec in row["arms"].items()
              if arm.startswith("ours") and rec.get("host_sync_clip") not in (None, "n/a")]  # fmt: skip
    detail = f"world size {world}, fp16 autocast; ours (device kernels), ours with foreach, torch"
    if synced:
        return run.add(Part(name, "failed", f"host sync in unscale_and_clip_: {', '.join(synced)}",
                            secs, table.read_text(encoding="utf-8")))  # fmt: skip
    return run.add(Part(name, "ok", detail, secs, table.read_text(encoding="utf-8")))


def _load_state(command: str, state: Path) -> list[tuple[str, Part]]:
    """The parts the other command left on this machine (none when it has not run here)."""
    try:
        data = json.loads(state.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    other = [c for c in COMMANDS if c != command]
    return [(c, Part(**p)) for c in other for p in data.get(c, {}).get("parts", [])]


def _save_state(command: str, run: Run, state: Path) -> None:
    try:
        data = json.loads(state.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = {}
    data[command] = {"parts": [p.__dict__ for p in run.parts]}
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps(data, indent=1), encoding="utf-8")


def write_report(run: Run, path: Path, *, command: str) -> None:
    """The Markdown report: this command's parts and those the other left (tests first)."""
    env = run.env
    theirs = _load_state(command, Path(run.args.state))
    mine = [(command, p) for p in run.parts]
    ordered = sorted([*theirs, *mine], key=lambda cp: list(COMMANDS).index(cp[0]))
    lines = [
        "# shardscale GPU check",
        "",
        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, {platform.node()}, "
        f"{env.get('executable', run.python)}; '{command}' took {time.monotonic() - run.start:.0f} s"
        f" of its {run.args.budget:.0f} s budget."
        + ("" if theirs else " (The other command has not run on this machine.)"),
        "",
        "| command | part | result | seconds | detail |",
        "| --- | --- | --- | ---: | --- |",
    ]
    for c, p in ordered:
        lines.append(f"| {c} | {p.name} | {p.status} | {p.seconds:.0f} | "
                     f"{p.detail.replace('|', '/')} |")  # fmt: skip
    for _, p in ordered:
        if p.output:
            fence = "" if p.output.lstrip().startswith(("|", "#")) or "\n| " in p.output else "```"
            lines += ["", f"## {p.name}", "", *([fence] if fence else []), p.output.strip(),
                      *([fence] if fence else [])]  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/gpu_check.py", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("command", choices=list(COMMANDS),
                        help="tests: install, doctor, CUDA and Triton tests; bench: the step-tail "
                        "benchmark (run tests first, then bench)")  # fmt: skip
    parser.add_argument("--wheelhouse", default=str(ROOT / ".nox" / "gpu-wheelhouse"),
                        help="folder with our wheels and the test dependencies "
                        "(nox -s gpu_wheelhouse builds it)")  # fmt: skip
    parser.add_argument("--site", default=str(SITE),
                        help=f"folder our wheels are installed into (default {SITE})")  # fmt: skip
    parser.add_argument("--state", default=str(STATE),
                        help="where each command leaves its parts for the other's report "
                        f"(default {STATE})")  # fmt: skip
    parser.add_argument("--no-install", action="store_true",
                        help="test the shardscale already installed in this Python")  # fmt: skip
    parser.add_argument("--report", default=str(ROOT / ".nox" / "gpu-check" / "report.md"),
                        help="the Markdown report to write")  # fmt: skip
    parser.add_argument("--python", default=sys.executable,
                        help="the Python to check and install into (default: this one)")  # fmt: skip
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds for this command (default {BUDGET_S:.0f}; a lease allows "
                        "at most 300 per command here)")  # fmt: skip
    parser.add_argument("--skip", action="append", default=[], choices=PARTS, metavar="PART",
                        help=f"leave a part out (repeatable): {', '.join(PARTS)}")  # fmt: skip
    parser.add_argument("--only", action="append", default=[], choices=PARTS, metavar="PART",
                        help="run only the parts named (repeatable); the others are skipped")  # fmt: skip
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply every limit and the budget (a slow, shared CPU's dry run: "
                        "importing torch alone can take 30 s there)")  # fmt: skip
    parser.add_argument("--quick-bench", action="store_true",
                        help="the bench parts on the smoke-sized model (--quick)")  # fmt: skip
    args = parser.parse_args(argv)
    if not 0 < args.budget <= 3600:
        parser.error(f"--budget must be from 1 to 3600 seconds, got {args.budget:g}")
    if not 0.1 <= args.time_scale <= 20:
        parser.error(f"--time-scale must be from 0.1 to 20, got {args.time_scale:g}")
    names = COMMANDS[args.command]
    if args.only:
        args.skip += [p for p in names if p not in args.only]
    run = Run(args)
    report = Path(args.report).resolve()
    print(f"shardscale GPU check '{args.command}' with {args.python}, {args.budget:.0f} s; "
          f"report: {report}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="shardscale-gpu-check-") as tmp:
        out_dir = Path(tmp)
        steps: dict[str, Any] = {
            "environment": lambda: check_environment(run),
            "install": lambda: install(run),
            "doctor": lambda: doctor(run),
            "cuda tests": lambda: _pytest(run, "cuda tests", _gpu_test_files()),
            "triton tests": lambda: _pytest(run, "triton tests", [str(TRITON_TESTS)]),
            "bench (8.4M)": lambda: bench(run, "bench (8.4M)", out_dir),
            "bench (33.6M)": lambda: bench(run, "bench (33.6M)", out_dir),
        }
        needs = {"cuda tests": _no_cuda, "triton tests": _no_triton,
                 "bench (8.4M)": _no_cuda, "bench (33.6M)": _no_cuda}  # fmt: skip
        stop: str | None = None
        for name in names:
            if name in args.skip:
                run.skip(name, "not in --only" if args.only and name not in args.only else "--skip")
            elif stop is not None:
                run.skip(name, stop)
            elif name in needs and (reason := needs[name](run)) is not None:
                run.skip(name, reason)
            elif run.left() < 5:
                run.skip(name, f"the time budget ({args.budget:.0f} s) is spent")
            else:
                most = min(LIMITS[name] * args.time_scale, run.left())
                print(f"[....] {name} (at most {most:.0f} s)", flush=True)
                part = steps[name]()
                if name in ("environment", "install") and part.status == "failed":
                    stop = f"not run: {name} failed"
        write_report(run, report, command=args.command)
        _save_state(args.command, run, Path(args.state))
    skipped = [p for p in run.parts if p.status == "skipped"]
    failed = [p for p in run.parts if p.status == "failed"]
    print(f"\n{len(run.parts) - len(skipped) - len(failed)} parts ok, {len(failed)} failed, "
          f"{len(skipped)} skipped; report: {report}")  # fmt: skip
    for p in skipped:
        print(f"  skipped {p.name}: {p.detail}")
    for p in failed:
        print(f"  FAILED {p.name}: {p.detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
