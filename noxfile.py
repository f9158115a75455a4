"""Sessions for the shardscale monorepo.

``nox -s tests`` (the default) installs every distribution from its own
directory into a fresh virtualenv with torch 2.13.0 (or ``$SHARDSCALE_TORCH``)
and runs every package's tests plus integration_tests/.
``nox -s tests_matrix`` runs the same over every torch version we support.
"""

from __future__ import annotations

import os
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
# The oldest entry is the floor every pyproject declares (torch>=2.13); test_packaging checks it.
TORCH_VERSIONS = ["2.13.0", "2.14.1"]
# Order matters for the isolated session only in that core comes first.
DISTS = [
    "shardscale-core",
    "shardscale-collectives",
    "shardscale-clip",
    "shardscale-fsdp",
    "shardscale-triton",
    "shardscale-telemetry",
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
    paths = [str(ROOT / "packages" / d / "tests") for d in DISTS] + [
        str(ROOT / "integration_tests")
    ]
    # Triton's interpreter for shardscale-triton's CPU tests: it must be on before anything
    # imports triton, and it changes nothing else (the kernels claim the CPU only where a test
    # also sets SHARDSCALE_TRITON_INTERPRET=1).
    session.run("pytest", *paths, *session.posargs, env={"TRITON_INTERPRET": "1"})


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
def bench(session: nox.Session) -> None:
    """The benchmark against torch (``shardscale bench``): about ten minutes on a 2-core CPU.

    World size 2, gloo on CPU: torch's recipe, torch again (A/A), unscale_and_clip_ and
    unscale_and_clip_ with streaming statistics, interleaved in a balanced order on 1-D and 2-D
    meshes, then the scaling table. Prints the tables; writes .nox/bench/bench.{json,md,png}.
    With ``-- --device cuda`` the step uses shardscale-triton's kernels where they are usable
    (run again with SHARDSCALE_DISABLE_PLUGINS=shardscale-triton for ``foreach``; GPU speed of
    the Triton kernels has not been measured yet).
    Extra arguments go to ``shardscale bench``, e.g. ``nox -s bench -- --quick`` or
    ``-- --from-json a.json b.json c.json --markdown`` (tables and ranges of earlier runs).
    """
    _install_torch(session, os.environ.get("SHARDSCALE_TORCH", DEFAULT_TORCH))
    # The shardscale distribution carries the benchmark; its ui extra draws the chart.
    others = [d for d in _package_dirs(frameworks=False) if not d.endswith(f"{os.sep}shardscale")]
    session.install(*others, str(ROOT / "packages" / "shardscale") + "[ui]")
    args = list(session.posargs)
    if not any(a == "--out" or a.startswith("--out=") for a in args):
        args += ["--out", str(ROOT / ".nox" / "bench")]
    session.run("shardscale", "bench", *args)


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


@nox.session(python=PYTHON, venv_params=["--system-site-packages"])
def gpu(session: nox.Session) -> None:
    """CUDA/NCCL tests (world size 1) on a machine with a GPU, using that machine's CUDA torch.

    Never part of CI: without CUDA every test it selects skips. shardscale-triton's kernel
    tests run here compiled on CUDA tensors (TRITON_INTERPRET must be unset).
    """
    session.install(*TEST_DEPS)
    session.install(*_package_dirs(frameworks=False))
    session.run(
        "python",
        "-c",
        "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())",
    )
    paths = [str(ROOT / "packages" / d / "tests") for d in DISTS if d not in FRAMEWORK_DISTS]
    paths.append(str(ROOT / "integration_tests"))
    session.run("pytest", "-m", "gpu", *paths, *session.posargs)


@nox.session(python=PYTHON, venv_params=["--system-site-packages"])
def bench_kernels(session: nox.Session) -> None:
    """foreach vs Triton stats kernels vs torch's recipe on one CUDA GPU: time, launches, syncs.

    Uses the machine's CUDA torch (like ``gpu``); never part of CI. ``-- --interpret`` is a CPU
    smoke run of the script through Triton's interpreter (it measures nothing).
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
    session.run("mypy", *(str(ROOT / "packages" / d / "src") for d in DISTS))


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
        silent=True,
    )


@nox.session(python=PYTHON)
@nox.parametrize("dist", DISTS)
def isolated(session: nox.Session, dist: str) -> None:
    """Install one distribution alone (only its declared dependencies) and run its own tests."""
    _build_wheels(session)
    _install_torch(session, DEFAULT_TORCH)
    session.install(*TEST_DEPS)
    # torch pinned in the same command: a framework dependency must not pull another torch.
    session.install(f"torch=={DEFAULT_TORCH}", "--find-links", str(WHEELHOUSE), dist)
    session.run("python", "-m", "pip", "list", silent=False)
    session.run("pytest", str(ROOT / "packages" / dist / "tests"), *session.posargs)
