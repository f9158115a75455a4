"""The code the docs show is the code that runs: the migration diff and the plugin example."""

from __future__ import annotations

import difflib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[3] / "docs" / "examples"

pytestmark = pytest.mark.skipif(
    not EXAMPLES.is_dir(), reason="docs/examples is not beside this package (installed alone)"
)


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_docs_example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_migration_diff_is_exactly_before_to_after() -> None:
    folder = EXAMPLES / "migration"
    before = (folder / "before.py").read_text().splitlines(keepends=True)
    after = (folder / "after.py").read_text().splitlines(keepends=True)
    expected = "".join(difflib.unified_diff(before, after, "a/train.py", "b/train.py", n=3))
    shipped = (folder / "migration.diff").read_text()
    assert shipped == expected, (
        "regenerate docs/examples/migration/migration.diff from the two files"
    )


def test_migrated_loop_trains_like_the_torch_loop() -> None:
    folder = EXAMPLES / "migration"
    torch_losses, torch_params = _load(folder / "before.py").train(12)
    our_losses, our_params = _load(folder / "after.py").train(12)
    assert our_losses == pytest.approx(torch_losses, rel=1e-6)
    for ours, theirs in zip(our_params, torch_params, strict=True):
        torch.testing.assert_close(ours, theirs)


def test_plugin_example_middleware_and_observer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES / "plugin"))
    monkeypatch.delitem(sys.modules, "shardscale_steplog", raising=False)
    use = _load(EXAMPLES / "plugin" / "use_steplog.py")
    plugin = sys.modules["shardscale_steplog"]
    plugin.STEP_LOG.clear()
    scaler = use.run(steps=3)
    # The middleware wrapped the backend and saw ONE reduction per step.
    assert type(scaler.backend).__name__ == "StepLogMiddleware"
    assert len(scaler.backend.calls) == 3
    assert all(op == "sum" for op, _ in scaler.backend.calls)
    # The observer saw every step, with the grad norm unscale_and_clip_ measured.
    assert [line.split(":")[0] for line in plugin.STEP_LOG] == ["step 1", "step 2", "step 3"]
    assert all("skipped=False" in line and "grad_norm=-" not in line for line in plugin.STEP_LOG)
    # Unregistered afterwards: the name is gone from the registry.
    from shardscale.core import get_registry

    assert "steplog" not in get_registry().names("middleware")


def test_plugin_example_observer_reports_a_skipped_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES / "plugin"))
    monkeypatch.delitem(sys.modules, "shardscale_steplog", raising=False)
    import shardscale_steplog as plugin

    from shardscale.core import ShardedGradScaler, get_registry

    plugin.STEP_LOG.clear()
    registry = get_registry()
    name = registry.register(plugin, name="steplog")
    try:
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ShardedGradScaler("cpu", init_scale=4.0)
        scaler.scale(model(torch.randn(2, 4)).sum()).backward()
        model.weight.grad[0, 0] = float("inf")  # an overflow, as fp16 would produce
        scaler.step(opt)
        scaler.update()
    finally:
        registry.unregister(name)
    assert plugin.STEP_LOG == ["step 1: scale=2 overflow=True skipped=True grad_norm=-"]


def test_plugin_example_packaging_declares_the_entry_point() -> None:
    import tomllib

    meta = tomllib.loads((EXAMPLES / "plugin" / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["shardscale"] == {"steplog": "shardscale_steplog"}
