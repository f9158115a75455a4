"""Fixtures for the shardscale command's tests: run the CLI as a user would, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

RunCli = Callable[..., subprocess.CompletedProcess[str]]


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    # A test must not inherit a launch from its caller (e.g. pytest run under torchrun).
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SHARDSCALE_DISABLE_PLUGINS",
                "SHARDSCALE_BACKEND"):  # fmt: skip
        env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@pytest.fixture
def run_cli() -> RunCli:
    """Run ``python -m shardscale.cli ARGS`` (or another module with ``module=``); never hangs."""

    def run(
        args: Sequence[str],
        *,
        module: str = "shardscale.cli",
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
        prelude: str | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        if prelude is None:
            cmd = [sys.executable, "-m", module, *args]
        else:
            # Run a few lines first (e.g. hide an optional dependency), then the module.
            code = f"{prelude}\nimport runpy, sys\nsys.argv = [{module!r}, *sys.argv[1:]]\n" \
                   f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"  # fmt: skip
            cmd = [sys.executable, "-c", code, *args]
        return subprocess.run(
            cmd, env=_env(env), capture_output=True, text=True, timeout=timeout, cwd=cwd,
            check=False,
        )  # fmt: skip

    return run
