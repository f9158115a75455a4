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
TORCH_VERSIONS = ["2.13.0", "2.14.1"]
# Order matters for the isolated session only in that core comes first.
DISTS = [
    "shardscale-core",
    "shardscale-collectives",
    "shardscale-clip",
    "shardscale-fsdp",
    "shardscale",
]
TEST_DEPS = ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100"]
# Third-party-style plugin distributions that only the tests install.
TEST_PLUGINS = sorted(
    p.parent for p in (ROOT / "integration_tests" / "plugins").glob("*/pyproject.toml")
)
WHEELHOUSE = ROOT / ".nox" / "_wheels"


def _install_torch(session: nox.Session, version: str) -> None:
    session.install(f"torch=={version}")


def _package_dirs() -> list[str]:
    return [str(ROOT / "packages" / d) for d in DISTS]


def _run_tests(session: nox.Session, torch_version: str) -> None:
    _install_torch(session, torch_version)
    session.install(*TEST_DEPS)
    session.install(*_package_dirs(), *(str(p) for p in TEST_PLUGINS))
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    paths = [str(ROOT / "packages" / d / "tests") for d in DISTS] + [
        str(ROOT / "integration_tests")
    ]
    session.run("pytest", *paths, *session.posargs)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Every package's tests and integration_tests/ (torch from $SHARDSCALE_TORCH, default 2.13.0)."""
    _run_tests(session, os.environ.get("SHARDSCALE_TORCH", DEFAULT_TORCH))


@nox.session(python=PYTHON)
@nox.parametrize("torch", TORCH_VERSIONS)
def tests_matrix(session: nox.Session, torch: str) -> None:
    """The tests session over every supported torch version."""
    _run_tests(session, torch)


@nox.session(python=PYTHON, venv_params=["--system-site-packages"])
def gpu(session: nox.Session) -> None:
    """CUDA/NCCL tests (world size 1) on a machine with a GPU, using that machine's CUDA torch.

    Never part of CI: without CUDA every test it selects skips.
    """
    session.install(*TEST_DEPS)
    session.install(*_package_dirs())
    session.run(
        "python",
        "-c",
        "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())",
    )
    paths = [str(ROOT / "packages" / d / "tests") for d in DISTS] + [
        str(ROOT / "integration_tests")
    ]
    session.run("pytest", "-m", "gpu", *paths, *session.posargs)


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
    session.run("mypy", *(str(ROOT / "packages" / d / "src") for d in DISTS))


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
    session.install("--find-links", str(WHEELHOUSE), dist)
    session.run("python", "-m", "pip", "list", silent=False)
    session.run("pytest", str(ROOT / "packages" / dist / "tests"), *session.posargs)
