"""When the registry picks the Triton kernels, how to opt out, and what ``plugins`` is told."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shardscale.core import Registry
from shardscale.triton import INTERPRET_ENV, TritonKernels


def test_installed_as_a_real_distribution() -> None:
    registry = Registry()
    assert "triton" in registry.names("kernels")
    info = next(p for p in registry.plugins() if p.name == "triton")
    assert info.distribution == "shardscale-triton"
    assert info.hooks == ("shardscale_stats_kernels",)


def test_never_chosen_on_the_cpu_in_a_normal_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    registry = Registry()
    assert registry.kernels_for(torch.device("cpu")).name != "triton"
    assert not TritonKernels().supports(torch.device("cpu"))
    item = next(i for i in registry.items() if i.kind == "kernels" and i.name == "triton")
    if not torch.cuda.is_available():
        assert not item.usable
        assert item.reason is not None and item.reason.startswith("no CUDA device")


def test_the_test_interpreter_selects_it_on_the_cpu_and_foreach_opts_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs in CI, where there is no CUDA device")
    monkeypatch.setenv(INTERPRET_ENV, "1")
    registry = Registry()
    assert registry.kernels_for(torch.device("cpu")).name == "triton"
    assert registry.kernels_for(torch.device("cpu"), "foreach").name == "foreach"
    item = next(i for i in registry.items() if i.kind == "kernels" and i.name == "triton")
    assert item.usable and item.reason is None
    # Interpreter mode cannot follow CUDA pointers: it never claims a GPU.
    assert not TritonKernels().supports(torch.device("cuda", 0))


def test_disable_plugins_blocks_it_before_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERPRET_ENV, "1")
    for blocked in ("triton", "shardscale-triton"):
        monkeypatch.setenv("SHARDSCALE_DISABLE_PLUGINS", blocked)
        registry = Registry()
        assert "triton" not in registry.names("kernels")
        assert registry.kernels_for(torch.device("cpu")).name != "triton"
        assert any(f.name == "triton" and f.blocked for f in registry.failures())


def test_reasons_name_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardscale.triton import _kernels

    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    kernels = TritonKernels()
    assert "CPU is not supported" in (kernels._reason_for(torch.device("cpu")) or "")
    assert "not supported" in (kernels._reason_for(torch.device("meta")) or "")
    broken = _kernels._Triton.__new__(_kernels._Triton)
    broken.error = "triton not importable: ImportError: libcuda missing"
    monkeypatch.setattr(_kernels, "_triton", broken)
    monkeypatch.setenv(INTERPRET_ENV, "1")
    assert TritonKernels().unavailable_reason() == broken.error


def test_the_package_does_not_shadow_or_eagerly_import_triton() -> None:
    code = (
        "import sys\n"
        "import shardscale.triton, shardscale.triton._plugin\n"
        "assert 'triton' not in sys.modules, 'listing plugins must not import triton'\n"
        "from shardscale.triton import _jit\n"
        "import triton\n"
        "from pathlib import Path\n"
        "where = Path(triton.__file__).parent  # the real package: site-packages/triton, not ours\n"
        "assert _jit.triton is triton and where.parent.name != 'shardscale', triton.__file__\n"
        "assert not hasattr(sys.modules['shardscale'], '__file__') or "
        "sys.modules['shardscale'].__file__ is None  # PEP 420 namespace\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
