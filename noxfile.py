"""Sessions for the shardscale monorepo.

``nox -s tests`` (the default) installs every distribution from its own
directory into a fresh virtualenv with torch 2.13.0 (or ``$SHARDSCALE_TORCH``)
and runs every package's tests plus integration_tests/.
``nox -s tests_matrix`` runs the same over every torch version we support
(TORCH_VERSIONS: the floor 2.11.0 up to 2.15.0; 2.11.0 and 2.15.0 come as CUDA
builds of several GB, which run on CPU). ``nox -s resolve`` asks pip whether each
of them installs beside every distribution and extra, ``nox -s triton_compile``
compiles the Triton kernels with the Triton each of them pins, and ``nox -s gpu``
runs the GPU check (tools/gpu_check.py) with the machine's own torch.
"""

from __future__ import annotations

import os
import re
import runpy
import shutil
from pathlib import Path

import nox

# pip/virtualenv only: uv would fetch CUDA builds of torch instead of the local CPU wheel.
nox.options.default_venv_backend = "virtualenv"
nox.options.sessions = ["tests"]
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
PYTHON = "3.11"
DEFAULT_TORCH = "2.13.0"
# The oldest entry is the floor every pyproject declares (torch>=2.11, TORCH_FLOOR in
# shardscale/cli/_floors.py); test_packaging checks it.
TORCH_VERSIONS = ["2.11.0", "2.13.0", "2.14.1", "2.15.0"]
# The floors and the Triton each torch pins, from the one module that states them (stdlib only).
FLOORS = runpy.run_path(
    str(ROOT / "packages" / "shardscale" / "src" / "shardscale" / "cli" / "_floors.py")
)
TRITON_PINS: dict[str, str] = FLOORS["TRITON_PINS"]
TRITON_VERSIONS = sorted(set(TRITON_PINS.values()), key=lambda v: tuple(map(int, v.split("."))))
# Order matters for the isolated session only in that core comes first.
DISTS = [
    "shardscale-core",
    "shardscale-collectives",
    "shardscale-clip",
    "shardscale-fsdp",
    "shardscale-triton",
    "shardscale-telemetry",
    "shardscale-schedules",
    "shardscale",
    "shardscale-lightning",
    "shardscale-accelerate",
    "shardscale-transformers",
    "shardscale-torchtitan",
]
# The trainer integrations and the framework releases their tests run (each dist declares a
# range around its pin). About 16-31 s to install lightning and accelerate into a venv that has
# torch (33 s with load average 12); transformers, trl and torchtitan add about 100 s at that load.
FRAMEWORK_DISTS = ["shardscale-lightning", "shardscale-accelerate", "shardscale-transformers"]
FRAMEWORKS = ["lightning==2.6.6", "accelerate==1.15.0", "transformers==5.24.0"]
# Frameworks only the tests install: TRL's trainers run on shardscale-transformers (SFT, GRPO);
# shardscale-torchtitan's drop-in is compared with torchtitan's own clip_grad_norm_ (it needs
# datasets<4.8, which pip resolves together with TRL's).
TEST_FRAMEWORKS = ["trl==1.16.0", "torchtitan==0.3.0"]
# shardscale-verl runs in a venv of its own (``nox -s verl``): verl 0.9 pins transformers<5.11
# and the tests session installs transformers 5.24. Not in DISTS, so the tests session never
# installs verl; the isolated session takes it as one more distribution. Installing verl beside
# torch takes about 2 minutes (7.5 with five other installs on the machine; a 2 GB venv).
VERL_DIST = "shardscale-verl"
VERL = "verl==0.9.1"
# shardscale-rlinf runs in a venv of its own (``nox -s rlinf``): RLinf 0.3.0 imports
# transformers' AutoModelForVision2Seq (gone in transformers 5) and does not declare transformers
# (its FSDP manager imports it), so the session pins the last 4.x RLinf's extras allow. Its own
# dependencies (ray, datasets, wandb, ... 155 distributions; no CUDA, torch stays) take minutes.
RLINF_DIST = "shardscale-rlinf"
RLINF = "rlinf==0.3.0"
RLINF_TRANSFORMERS = "transformers==4.57.6"
# verl 0.7's legacy actor (``nox -s verl_legacy``): a venv of its own again. verl 0.7.1 pins
# numpy<2 and leaves transformers, datasets and pyarrow open, and the newest of those do not run
# with it: transformers 5 makes ``_no_split_modules`` a set, which verl 0.7's ``apply_fsdp2``
# indexes (TypeError); pyarrow 26 needs numpy 2; datasets 5 needs a huggingface_hub that
# transformers 4 refuses. So the releases of its time are pinned beside it.
# From this tree, each of these sessions installs its distribution and the CLI (for ``shardscale
# plugins``/``doctor``) with every distribution of this tree they depend on (``_local_closure``
# reads them from the pyprojects: a new one cannot be forgotten).
VERL_LEGACY = "verl==0.7.1"
VERL_LEGACY_PINS = ["transformers==4.57.6", "datasets==4.4.1", "pyarrow==22.0.0"]
# Extras the tests session installs with their distribution (the observers' own libraries).
TEST_EXTRAS = {"shardscale-telemetry": "tensorboard,wandb"}
# numpy: torch's own test-side tools (CommDebugMode, all_gather_object, DCP) import it.
# hatchling: test_plugin_isolation builds the misbehaving plugin distributions offline
# (pip --no-build-isolation) and installs them into a throwaway folder.
TEST_DEPS = ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "numpy", "hatchling>=1.21"]
# Third-party-style plugin distributions that only the tests install. (plugins/misbehaving/*
# are one level deeper on purpose: test_plugin_isolation installs them into a folder of its own.)
TEST_PLUGINS = sorted(
    p.parent for p in (ROOT / "integration_tests" / "plugins").glob("*/pyproject.toml")
)
WHEELHOUSE = ROOT / ".nox" / "_wheels"


def _local_closure(roots: list[str]) -> list[str]:
    """``roots`` and every distribution of packages/ they depend on, transitively, sorted."""
    import tomllib

    local = {d.name for d in (ROOT / "packages").iterdir() if (d / "pyproject.toml").exists()}
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        with open(ROOT / "packages" / dist / "pyproject.toml", "rb") as f:
            requires = tomllib.load(f)["project"].get("dependencies", [])
        names = (re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0] for r in requires)
        todo.extend(n for n in names if n in local)
    return sorted(seen)


def _install_torch(session: nox.Session, version: str) -> None:
    session.install(f"torch=={version}")


def _package_dirs(*, frameworks: bool = True) -> list[str]:
    """Every distribution's directory; without the trainer integrations when ``frameworks`` is False."""
    return [str(ROOT / "packages" / d) for d in DISTS if frameworks or d not in FRAMEWORK_DISTS]


def _with_test_extras(dirs: list[str]) -> list[str]:
    return [d + (f"[{TEST_EXTRAS[Path(d).name]}]" if Path(d).name in TEST_EXTRAS else "")
            for d in dirs]  # fmt: skip


def _run_tests(session: nox.Session, torch_version: str) -> None:
    _install_torch(session, torch_version)
    session.install(*TEST_DEPS)
    # torch pinned in the same command: lightning/accelerate must not pull another torch.
    session.install(
        f"torch=={torch_version}",
        *_with_test_extras(_package_dirs()),
        *(str(p) for p in TEST_PLUGINS),
        *FRAMEWORKS,
        *TEST_FRAMEWORKS,
    )
    # shardscale's "ui" extra: the demo tests check the plot (the isolated session runs without it).
    session.install("rich>=13", "matplotlib>=3.7")
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    # benchmarks/tests: the scale table's simulator and NCCL model (not in any wheel).
    paths = [str(ROOT / "packages" / d / "tests") for d in DISTS] + [
        str(ROOT / "integration_tests"),
        str(ROOT / "benchmarks" / "tests"),
    ]
    # Triton's interpreter for shardscale-triton's CPU tests: it must be on before anything
    # imports triton, and it changes nothing else (the kernels claim the CPU only where a test
    # also sets SHARDSCALE_TRITON_INTERPRET=1).
    # The install-lines test (marked slow: fresh clones and virtualenvs, minutes of pip) has its
    # own session, install_lines, so that this one stays within CI's time.
    # --durations: the slowest tests in CI's log, to keep its time in view.
    args = session.posargs or ["-m", "not slow", "--durations=30"]
    session.run("pytest", *paths, *args, env={"TRITON_INTERPRET": "1"})


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Every package's tests and integration_tests/ (torch from $SHARDSCALE_TORCH, default 2.13.0)."""
    _run_tests(session, os.environ.get("SHARDSCALE_TORCH", DEFAULT_TORCH))


@nox.session(python=PYTHON)
@nox.parametrize("torch", TORCH_VERSIONS)
def tests_matrix(session: nox.Session, torch: str) -> None:
    """The tests session over every supported torch version."""
    _run_tests(session, torch)


@nox.session(python=PYTHON)
def install_lines(session: nox.Session) -> None:
    """The first install command of getting-started and of each integration page, run as written
    in a fresh virtualenv on a fresh clone (integration_tests/test_install_lines.py)."""
    _install_torch(session, os.environ.get("SHARDSCALE_TORCH", DEFAULT_TORCH))
    session.install(*TEST_DEPS)
    test = ROOT / "integration_tests" / "test_install_lines.py"
    session.run("pytest", str(test), "-m", "slow", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The benchmark against torch (``shardscale bench``): about ten minutes on a 2-core CPU.

    World size 2, gloo on CPU: torch's recipe, torch again (A/A), unscale_and_clip_ and
    unscale_and_clip_ with streaming statistics, interleaved in a balanced order on 1-D and 2-D
    meshes, then the scaling table. Prints the tables; writes .nox/bench/bench.{json,md,png}.
    With ``-- --device cuda`` (on a GPU machine, offline) it runs with that machine's Python,
    torch and Triton, our wheels installed from .nox/gpu-wheelhouse: torch vs ours with the
    device's kernels (shardscale-triton's where installed) vs ours with ``foreach``, with
    launches per step (profiler) and host syncs (``set_sync_debug_mode("error")``).
    Extra arguments go to ``shardscale bench``, e.g. ``nox -s bench -- --quick`` or
    ``-- --from-json a.json b.json c.json --markdown`` (tables and ranges of earlier runs).
    """
    args = list(session.posargs)
    if not any(a == "--out" or a.startswith("--out=") for a in args):
        args += ["--out", str(ROOT / ".nox" / "bench")]
    if _device_arg(args) == "cuda":
        _bench_with_machine_torch(session, args)
        return
    _install_torch(session, os.environ.get("SHARDSCALE_TORCH", DEFAULT_TORCH))
    # The shardscale distribution carries the benchmark; its ui extra draws the chart.
    others = [d for d in _package_dirs(frameworks=False) if not d.endswith(f"{os.sep}shardscale")]
    session.install(*others, str(ROOT / "packages" / "shardscale") + "[ui]")
    session.run("shardscale", "bench", *args)


def _device_arg(args: list[str]) -> str | None:
    """The value of ``--device`` among ``shardscale bench``'s arguments, if given."""
    for i, arg in enumerate(args):
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
        if arg == "--device" and i + 1 < len(args):
            return args[i + 1]
    return None


def _bench_with_machine_torch(session: nox.Session, args: list[str]) -> None:
    """``shardscale bench --device cuda`` with the GPU machine's own Python, torch and Triton.

    Nothing is downloaded: our wheels go in with --no-deps from .nox/gpu-wheelhouse (built
    here when missing, which needs network) into .nox/gpu-site, through tools/gpu_check.py's
    install part. The
    Python is $SHARDSCALE_GPU_PYTHON, else the one running nox (where nox was installed
    beside torch); the session's own virtualenv is not used.
    """
    import sys

    python = os.environ.get("SHARDSCALE_GPU_PYTHON", sys.executable)
    if not any(GPU_WHEELHOUSE.glob("shardscale_core-*.whl")):
        session.log(f"no wheelhouse at {GPU_WHEELHOUSE}: building it (this step needs network)")
        _build_gpu_wheelhouse(session, python)
    check = [str(ROOT / "tools" / "gpu_check.py"), "tests", "--wheelhouse", str(GPU_WHEELHOUSE),
             "--only", "environment", "--only", "install",
             "--report", str(ROOT / ".nox" / "bench" / "install.md")]  # fmt: skip
    session.run(python, *check, external=True)
    # gpu_check installs our wheels into a folder of their own (the machine's stay untouched).
    site = str(ROOT / ".nox" / "gpu-site")
    session.run(python, "-m", "shardscale.cli", "bench", *args, external=True,
                env={"PYTHONPATH": site})  # fmt: skip


@nox.session(python=PYTHON)
def bench_scale(session: nox.Session) -> None:
    """The scale table: the step engine simulated at 1 024 to 131 072 ranks in one process.

    torch's fake process group and a DeviceMesh of each size, tiny FSDP2-style DTensor and plain
    parameters; the vector's bytes, the host time to build and decide (95 % intervals), the
    decisions checked with and without an inf on the last rank, and the all-reduce modelled with
    NCCL's tuning model against an 8-byte one (docs/benchmark.md). About five minutes on 2 cores.
    Writes .nox/bench/bench-scale.{json,md}; extra arguments go to benchmarks/bench_scale.py
    (e.g. ``-- --worlds 1024 16384 --repeats 5``, ``-- --quick``). The simulator lives in
    benchmarks/, not in any wheel; it needs core and shardscale-fsdp only.
    """
    _install_torch(session, os.environ.get("SHARDSCALE_TORCH", DEFAULT_TORCH))
    session.install(*(str(ROOT / "packages" / d) for d in ("shardscale-core",
                                                          "shardscale-collectives",
                                                          "shardscale-fsdp")))  # fmt: skip
    args = list(session.posargs)
    if not any(a == "--out" or a.startswith("--out=") for a in args):
        args += ["--out", str(ROOT / ".nox" / "bench")]
    session.run("python", str(ROOT / "benchmarks" / "bench_scale.py"), *args)


@nox.session(python=PYTHON)
def bench_host(session: nox.Session) -> None:
    """The host table: work before the optimizer vs 500 -> 20 000 tiny FSDP2 parameters.

    2 gloo ranks x 1 thread: torch's unscale_ + clip_grad_norm_, torch again (A/A) and
    unscale_and_clip_, each reading the norm, interleaved; warm and cold (first call on a new
    layout; torch's only while its projected cost fits --torch-budget, 240 s). About ten
    minutes on 2 cores. Runs ``shardscale bench host``; writes .nox/bench_host/host.json;
    ``-- --quick`` is a smoke run, ``-- --from-json FILE`` prints an earlier run's table, ``--
    --markdown`` the table as in docs/benchmark.md.
    """
    _install_torch(session, os.environ.get("SHARDSCALE_TORCH", DEFAULT_TORCH))
    session.install(*_package_dirs(frameworks=False))
    args = list(session.posargs)
    if "--from-json" not in args and not any(a == "--out" or a.startswith("--out=") for a in args):
        args += ["--out", str(ROOT / ".nox" / "bench_host")]
    session.run("shardscale", "bench", "host", *args)


@nox.session(python=PYTHON)
def stress(session: nox.Session) -> None:
    """Long randomized runs: the 4-rank overflow fuzz for hundreds of steps and thousands of
    random scaler call sequences (the tests session runs short versions of both)."""
    _install_torch(session, os.environ.get("SHARDSCALE_TORCH", DEFAULT_TORCH))
    session.install(*TEST_DEPS)
    session.install(*_package_dirs(frameworks=False))
    env = {
        "SHARDSCALE_FUZZ_STEPS": os.environ.get("SHARDSCALE_FUZZ_STEPS", "400"),
        "SHARDSCALE_HYPOTHESIS_EXAMPLES": os.environ.get("SHARDSCALE_HYPOTHESIS_EXAMPLES", "3000"),
    }
    session.run(
        "pytest",
        str(ROOT / "integration_tests" / "test_fuzz_agreement.py"),
        str(ROOT / "packages" / "shardscale-core" / "tests" / "test_state_machine_property.py"),
        *session.posargs,
        env=env,
    )


def _extras(dist: str) -> list[str]:
    """Every extra ``dist`` declares, read from its pyproject.toml."""
    import tomllib

    with open(ROOT / "packages" / dist / "pyproject.toml", "rb") as f:
        return sorted(tomllib.load(f)["project"].get("optional-dependencies", {}))


def _every_dist_and_extra() -> list[str]:
    return [
        str(ROOT / "packages" / d) + (f"[{','.join(_extras(d))}]" if _extras(d) else "")
        for d in DISTS
    ]


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _conflict(output: str) -> str:
    """The lines of pip's answer that name the conflict (or its last lines)."""
    lines = output.strip().splitlines()
    for marker in ("The conflict is caused by:", "ResolutionImpossible", "ERROR:"):
        hit = next((i for i, line in enumerate(lines) if marker in line), None)
        if hit is not None:
            return "\n".join(lines[hit : hit + 12])
    return "\n".join(lines[-12:])


@nox.session(python=PYTHON)
def resolve(session: nox.Session) -> None:
    """Ask pip, installing nothing, whether each supported torch resolves beside every
    distribution with every extra and the trainer integrations; fail on the first conflict.

    ``torch===X`` (string equality) picks the release's own wheel, so a local ``+cpu`` build
    cannot stand in for the CUDA build whose pins (Triton, NCCL, CUDA libraries) are the ones
    that conflict; pip reads their metadata only (a few MB, no multi-GB download). The Triton
    pip chooses must be the one shardscale/cli/_floors.py pairs with that torch.
    """
    import json

    out = Path(session.create_tmp())
    versions = session.posargs or TORCH_VERSIONS
    for version in versions:
        report = out / f"resolve-torch-{version}.json"
        args = ["--dry-run", "--ignore-installed", "--report", str(report)]
        got = session.run(
            "python", "-m", "pip", "install", *args, f"torch==={version}",
            *_every_dist_and_extra(), *(str(p) for p in TEST_PLUGINS),
            silent=True, success_codes=[0, 1],
        )  # fmt: skip
        if not report.exists():
            session.error(f"torch {version} does not resolve with every distribution:\n"
                          f"{_conflict(str(got))}")  # fmt: skip
        chosen = {
            item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text(encoding="utf-8"))["install"]
        }
        missing = [d for d in DISTS if d not in chosen]
        if chosen.get("torch") != version or missing:
            session.error(
                f"torch {version}: pip chose torch {chosen.get('torch')}, left out {missing}"
            )
        want = TRITON_PINS[_minor(version)]
        if chosen.get("triton") != want:
            session.error(f"torch {version}: pip chose triton {chosen.get('triton')}, but "
                          f"_floors.TRITON_PINS pairs it with {want}: update TRITON_PINS")  # fmt: skip
        nccl = next((f"{n} {v}" for n, v in chosen.items() if n.startswith("nvidia-nccl")), "none")
        session.log(f"torch {version} resolves: triton {chosen['triton']}, {nccl}, "
                    f"{len(chosen)} distributions in all")  # fmt: skip


@nox.session(python=PYTHON)
@nox.parametrize("triton", TRITON_VERSIONS)
def triton_compile(session: nox.Session, triton: str) -> None:
    """Compile every shardscale-triton kernel variant to a cubin for sm_80 and sm_90 with one
    Triton release that a supported torch pins (no GPU: ptxas ships in the triton wheel); with
    the oldest and the newest, also run the kernels' tests through Triton's interpreter.

    torch is the 2.13.0 CPU build throughout (the kernels' module needs torch, the compiler
    does not); tests_matrix runs the interpreter tests beside each torch's own Triton too.
    """
    _install_torch(session, DEFAULT_TORCH)
    session.install(*TEST_DEPS)
    session.install(
        f"torch=={DEFAULT_TORCH}",
        f"triton=={triton}",
        str(ROOT / "packages" / "shardscale-core"),
        str(ROOT / "packages" / "shardscale-triton"),
    )
    session.run("python", "-c", "import triton; print('triton', triton.__version__)")
    tests = ROOT / "packages" / "shardscale-triton" / "tests"
    env = {"TRITON_INTERPRET": "", "TRITON_CACHE_DIR": session.create_tmp() + "/triton-cache"}
    session.run("python", str(tests / "_compile_all.py"), "80", "90", env=env)
    if triton in (TRITON_VERSIONS[0], TRITON_VERSIONS[-1]):
        # test_compile.py repeats the compile above in a subprocess: once is enough here.
        session.run("pytest", str(tests), "--ignore", str(tests / "test_compile.py"),
                    *session.posargs, env={"TRITON_INTERPRET": "1"})  # fmt: skip


GPU_WHEELHOUSE = ROOT / ".nox" / "gpu-wheelhouse"
# Pure-Python wheels the GPU check's tests need, with their own requirements (pip download
# resolves those); nothing compiled, so they install on any Python >= 3.11 and platform.
GPU_TEST_DEPS = ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "pluggy>=1.3"]


def _build_gpu_wheelhouse(session: nox.Session, python: str) -> None:
    if GPU_WHEELHOUSE.exists():
        shutil.rmtree(GPU_WHEELHOUSE)
    GPU_WHEELHOUSE.mkdir(parents=True)
    pip = [python, "-m", "pip"]
    dest = str(GPU_WHEELHOUSE)
    session.run(*pip, "wheel", "--no-deps", "-w", dest, *_package_dirs(frameworks=False),
                silent=True, external=True)  # fmt: skip
    # Pure-Python wheels only (py3-none-any), so they install on the GPU machine's Python and
    # platform whatever they are.
    pure = ["--only-binary=:all:", "--implementation", "py", "--abi", "none", "--platform", "any",
            "--python-version", PYTHON]  # fmt: skip
    session.run(*pip, "download", *pure, "--dest", dest, *GPU_TEST_DEPS, silent=True,
                external=True)  # fmt: skip
    names = sorted(p.name for p in GPU_WHEELHOUSE.glob("*.whl"))
    session.log(f"{len(names)} wheels in {GPU_WHEELHOUSE}: {', '.join(names)}")


@nox.session(python=PYTHON)
def gpu_wheelhouse(session: nox.Session) -> None:
    """Build .nox/gpu-wheelhouse for tools/gpu_check.py: our wheels and the pure-Python test
    dependencies, so that a GPU machine without network installs from it (bring the folder)."""
    _build_gpu_wheelhouse(session, "python")


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The GPU check with the machine's own Python, torch and Triton: tools/gpu_check.py's two
    commands, ``tests`` then ``bench``, each within 5 minutes (one lease; docs/supported.md).

    Installs our wheels with --no-deps from .nox/gpu-wheelhouse into .nox/gpu-site (``nox -s
    gpu_wheelhouse`` builds the folder, here, when it is missing; on a GPU machine without
    network bring it along), then ``tests``: the environment against our floors, ``shardscale
    doctor``, the CUDA tests and the compiled Triton tests; and ``bench``: ``shardscale bench
    --device cuda --amp fp16`` on the memory table's 8.4M and 33.6M models, torch vs ours
    (device kernels and foreach), launches and host syncs. One report (default
    .nox/gpu-check/report.md). Arguments go to both commands, e.g. ``nox -s gpu --
    --no-install``. Never part of CI.
    """
    python = os.environ.get("SHARDSCALE_GPU_PYTHON", "python")
    args = list(session.posargs)
    if "--no-install" not in args and not any(GPU_WHEELHOUSE.glob("shardscale_core-*.whl")):
        session.log(f"no wheelhouse at {GPU_WHEELHOUSE}: building it (this step needs network)")
        _build_gpu_wheelhouse(session, python)
    for command in ("tests", "bench"):
        session.run(python, str(ROOT / "tools" / "gpu_check.py"), command, "--wheelhouse",
                    str(GPU_WHEELHOUSE), *args, external=True, success_codes=[0, 1])  # fmt: skip


@nox.session(python=PYTHON)
def gpu_dry_run(session: nox.Session) -> None:
    """The GPU check's two commands on this CPU, as the GPU machine would run them: a fresh
    Python 3.11 with torch and nothing else (no hatchling, no pytest: they must come from the
    wheelhouse), our wheels and the test dependencies installed with ``pip --no-index`` from
    .nox/gpu-wheelhouse; every part starts, or is skipped with its reason (no CUDA here).

    torch is 2.13.0, the CPU build on this machine's disk: torch 2.11.0 (the GPU image's) has
    no CPU build here, and PyPI's is the 530 MB CUDA build that pulls several GB of CUDA
    libraries. Reports in .nox/gpu-dry-run/.
    """
    if not any(GPU_WHEELHOUSE.glob("shardscale_core-*.whl")):
        _build_gpu_wheelhouse(session, "python")
    _install_torch(session, os.environ.get("SHARDSCALE_TORCH", DEFAULT_TORCH))
    session.run("python", "-c", "import importlib.util as u, sys; "
                "sys.exit('hatchling is installed' if u.find_spec('hatchling') else 0)")  # fmt: skip
    out = ROOT / ".nox" / "gpu-dry-run"
    for command in ("tests", "bench"):
        session.run("python", str(ROOT / "tools" / "gpu_check.py"), command, "--wheelhouse",
                    str(GPU_WHEELHOUSE), "--report", str(out / "report.md"), *session.posargs)  # fmt: skip


@nox.session(python=PYTHON, venv_params=["--system-site-packages"])
def bench_kernels(session: nox.Session) -> None:
    """foreach vs Triton stats kernels vs torch's recipe on one CUDA GPU: time, launches, syncs.

    Uses the machine's CUDA torch; never part of CI (``gpu`` runs the same script offline,
    from the wheelhouse). ``-- --interpret`` is a CPU smoke run of the script through Triton's
    interpreter (it measures nothing).
    """
    session.install(str(ROOT / "packages" / "shardscale-core"))
    session.install(str(ROOT / "packages" / "shardscale-triton"))
    session.run("python", str(ROOT / "benchmarks" / "triton_kernels.py"), *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every package's sources."""
    _install_torch(session, DEFAULT_TORCH)
    session.install("mypy>=1.10", "pluggy>=1.3", "rich", "matplotlib")
    session.install(f"torch=={DEFAULT_TORCH}", *FRAMEWORKS)  # the integrations' base classes
    # shardscale-verl's and shardscale-rlinf's sources too: verl and RLinf are not installed here
    # (mypy skips their imports).
    session.run("mypy", *(str(ROOT / "packages" / d / "src") for d in [*DISTS, VERL_DIST,
                                                                       RLINF_DIST]))  # fmt: skip


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the docs site (Sphinx + MyST, API from docstrings) into docs/_build/html; warnings fail."""
    _install_torch(session, DEFAULT_TORCH)
    session.install("sphinx>=8,<10", "myst-parser>=4")
    session.install(f"torch=={DEFAULT_TORCH}", *_package_dirs(), *FRAMEWORKS)
    out = ROOT / "docs" / "_build" / "html"
    args = ["-W", "--keep-going", "-b", "html", str(ROOT / "docs"), str(out)]
    session.run("sphinx-build", *args, *session.posargs)
    session.log(f"docs: {out / 'index.html'}")


def _skips_outside_xfail(junit: Path) -> list[str]:
    """The tests a JUnit report says were skipped (an expected failure is not a skip)."""
    import xml.etree.ElementTree as ET

    found = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        for skipped in case.iter("skipped"):
            if skipped.get("type") != "pytest.xfail":
                found.append(
                    f"{case.get('classname')}::{case.get('name')}: {skipped.get('message')}"
                )
    return found


def _own_venv_tests(
    session: nox.Session,
    *,
    dist: str,
    framework: str,
    install: list[str],
    versions: str,
    tests: list[Path],
    must_run: str,
    may_skip: str | None = None,
) -> None:
    """An integration's tests in a venv of its own, with its framework's real code.

    Installs torch, the test tools and ``install`` (torch pinned in the same command: the
    framework must not pull another torch) with ``dist``'s in-tree closure and the CLI; prints
    ``versions`` (Python run in the venv); checks that ``shardscale plugins`` lists ``dist`` and
    ``shardscale doctor`` finds it with ``framework``; runs ``tests``; and fails unless tests
    whose class path holds ``must_run`` ran and none of them was skipped (``may_skip``: a
    module that skips here by design), so a framework that stops importing cannot turn the
    session green.
    """
    _install_torch(session, DEFAULT_TORCH)
    session.install(*TEST_DEPS)
    closure = _local_closure([dist, "shardscale"])
    session.install(f"torch=={DEFAULT_TORCH}", *install,
                    *(str(ROOT / "packages" / d) for d in closure))  # fmt: skip
    session.run("python", "-c", versions)
    listed = session.run("shardscale", "plugins", silent=True)
    if dist not in str(listed):
        session.error(f"`shardscale plugins` does not list {dist}:\n{listed}")
    checked = session.run("shardscale", "doctor", "--json", silent=True, success_codes=[0, 1])
    # Matched in the text: the run's output may carry lines on stderr beside the JSON.
    if not re.search(rf'"check": "{dist}",\s*"status": "ok"', str(checked)):
        session.error(f"`shardscale doctor` does not find {dist} with {framework}:\n{checked}")
    junit = Path(session.create_tmp()) / f"{session.name}-junit.xml"
    session.run("pytest", *map(str, tests), "--junitxml", str(junit), *session.posargs)
    import xml.etree.ElementTree as ET

    cases = ET.parse(junit).getroot().iter("testcase")
    if not any(must_run in str(c.get("classname")) for c in cases):
        session.error(f"no test of {must_run} ran")
    skipped = [
        s
        for s in _skips_outside_xfail(junit)
        if must_run in s.split(": ")[0] and (may_skip is None or may_skip not in s.split(": ")[0])
    ]
    if skipped:
        session.error(
            f"{must_run} tests were skipped here, where {framework} is installed:\n"
            + "\n".join(skipped)
        )


_PACKAGING_TESTS = ROOT / "packages" / "shardscale" / "tests" / "test_packaging.py"


@nox.session(python=PYTHON)
def verl(session: nox.Session) -> None:
    """shardscale-verl's tests with verl's real FSDP engine (verl 0.9.1) on 2 gloo ranks.

    A venv of its own (verl pins transformers<5.11); fails if any of the tests was skipped but
    test_legacy_actor.py (verl 0.7's: ``nox -s verl_legacy``).
    """
    _own_venv_tests(
        session,
        dist=VERL_DIST,
        framework="verl",
        install=[VERL],
        versions="import torch, verl; print('torch', torch.__version__, 'verl', verl.__version__)",
        tests=[ROOT / "packages" / VERL_DIST / "tests", _PACKAGING_TESTS],
        must_run="verl",
        may_skip="test_legacy_actor",
    )


@nox.session(python=PYTHON)
def rlinf(session: nox.Session) -> None:
    """shardscale-rlinf's tests with RLinf's real FSDPModelManager (RLinf 0.3.0) on 2 gloo ranks.

    A venv of its own (RLinf 0.3.0 needs transformers 4.x); fails if any of the tests was
    skipped. Not part of ``nox -s tests``.
    """
    _own_venv_tests(
        session,
        dist=RLINF_DIST,
        framework="rlinf",
        install=[RLINF, RLINF_TRANSFORMERS],
        versions="import torch, transformers, importlib.metadata as md; print('torch', "
        "torch.__version__, 'rlinf', md.version('rlinf'), 'transformers', transformers.__version__)",
        tests=[ROOT / "packages" / RLINF_DIST / "tests", _PACKAGING_TESTS],
        must_run="rlinf",
    )


@nox.session(python=PYTHON)
def verl_legacy(session: nox.Session) -> None:
    """shardscale-verl's tests with verl 0.7.1's legacy actor (DataParallelPPOActor), 2 gloo ranks.

    A venv of its own (verl 0.7.1 with the transformers 4 of its time); not part of ``tests``
    (CI's time). The engine tests (verl 0.9) skip here; the session fails if any of
    test_legacy_actor.py was skipped.
    """
    _own_venv_tests(
        session,
        dist=VERL_DIST,
        framework="verl",
        install=[VERL_LEGACY, *VERL_LEGACY_PINS],
        versions="import torch, transformers, verl; print('torch', torch.__version__, 'verl', "
        "verl.__version__, 'transformers', transformers.__version__)",
        tests=[ROOT / "packages" / VERL_DIST / "tests"],
        must_run="test_legacy_actor",
    )


def _build_wheels(session: nox.Session) -> None:
    if WHEELHOUSE.exists():
        shutil.rmtree(WHEELHOUSE)
    WHEELHOUSE.mkdir(parents=True)
    session.run(
        "python",
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "-w",
        str(WHEELHOUSE),
        *_package_dirs(),
        str(ROOT / "packages" / VERL_DIST),
        str(ROOT / "packages" / RLINF_DIST),
        silent=True,
    )


@nox.session(python=PYTHON)
@nox.parametrize("dist", [*DISTS, VERL_DIST, RLINF_DIST])
def isolated(session: nox.Session, dist: str) -> None:
    """Install one distribution alone (only its declared dependencies) and run its own tests."""
    _build_wheels(session)
    _install_torch(session, DEFAULT_TORCH)
    session.install(*TEST_DEPS)
    # torch pinned in the same command: a framework dependency must not pull another torch.
    session.install(f"torch=={DEFAULT_TORCH}", "--find-links", str(WHEELHOUSE), dist)
    session.run("python", "-m", "pip", "list", silent=False)
    session.run("pytest", str(ROOT / "packages" / dist / "tests"), *session.posargs)
