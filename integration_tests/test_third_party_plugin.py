"""A separately installed distribution's backend is discovered through its entry point.

``integration_tests/plugins/shardscale-example-backend`` stands in for a third
party: nox installs it into the test environment (never shipped). These tests
select its ``example`` backend by name, from the argument and from
``SHARDSCALE_BACKEND``, in one process and across two ranks.
"""

from __future__ import annotations

import importlib.metadata as md
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool

from shardscale.core import ShardedGradScaler, get_registry
from shardscale.core.plugins import BACKEND_ENV

DIST = "shardscale-example-backend"


@pytest.fixture(scope="module", autouse=True)
def _installed() -> None:
    try:
        md.distribution(DIST)
    except md.PackageNotFoundError:
        pytest.fail(
            f"the test-only plugin distribution {DIST!r} is not installed; run "
            f"'pip install -e integration_tests/plugins/{DIST}' (nox does this)"
        )


def _one_step(scaler: ShardedGradScaler, *, poison: bool) -> bool:
    """One scaler iteration on a plain parameter; True when the step was skipped."""
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler.scale(torch.ones(()))
    param.grad = torch.full((2,), 4.0)
    if poison:
        param.grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    return bool(torch.equal(param.detach(), torch.ones(2)))


def test_listed_with_its_distribution_and_version() -> None:
    item = next(
        (i for i in get_registry().items() if i.kind == "backend" and i.name == "example"), None
    )
    assert item is not None, "the 'example' backend was not discovered"
    assert item.distribution == DIST
    assert item.version == md.version(DIST)
    assert item.usable
    plugin = next(p for p in get_registry().plugins() if p.name == item.plugin)
    assert plugin.distribution == DIST
    assert "shardscale_collective_backends" in plugin.hooks


def test_selected_by_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardscale_example_backend import ExampleBackend

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    scaler = ShardedGradScaler("cpu", backend="example")
    assert type(scaler.backend) is ExampleBackend
    before = ExampleBackend.calls
    assert not _one_step(scaler, poison=False)
    assert ExampleBackend.calls == before + 1


def test_selected_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardscale_example_backend import ExampleBackend

    monkeypatch.setenv(BACKEND_ENV, "example")
    assert type(get_registry().make_backend()) is ExampleBackend
    scaler = ShardedGradScaler("cpu")
    before = ExampleBackend.calls
    assert _one_step(scaler, poison=True)
    assert ExampleBackend.calls == before + 1
    # Qualified by its distribution name, too.
    assert type(get_registry().make_backend(f"{DIST}:example")) is ExampleBackend


def _distributed_case() -> dict[str, Any]:
    import os

    from shardscale_example_backend import ExampleBackend

    os.environ[BACKEND_ENV] = "example"  # restored by the harness after the case
    scaler = ShardedGradScaler("cpu")
    before = ExampleBackend.calls
    # Overflow on the last rank only: the example backend must carry it to every rank.
    skipped = _one_step(scaler, poison=dist.get_rank() == dist.get_world_size() - 1)
    return {
        "backend": type(scaler.backend).__name__,
        "calls": ExampleBackend.calls - before,
        "skipped": skipped,
        "scale": scaler.get_scale(),
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_selected_by_environment_across_ranks(pool2: Pool) -> None:
    results = pool2.run(_distributed_case, timeout=60)
    for result in results:
        assert result == {
            "backend": "ExampleBackend",
            "calls": 1,
            "skipped": True,
            "scale": 2.0**16 * 0.5,
        }
