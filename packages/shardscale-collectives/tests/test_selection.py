"""SHARDSCALE_BACKEND and the automatic choice, with a real single-rank process group."""

from __future__ import annotations

import pytest
import torch

from shardscale.collectives import C10dBackend, CountingMiddleware, chain_names, find_middleware
from shardscale.core import PluginNotFoundError, ShardedGradScaler, get_registry
from shardscale.core.plugins import BACKEND_ENV

pytestmark = pytest.mark.usefixtures("world1")


def test_automatic_choice_is_c10d_when_a_group_is_initialized(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert isinstance(get_registry().make_backend(), C10dBackend)
    assert isinstance(ShardedGradScaler("cpu").backend, C10dBackend)


def test_environment_selects_a_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, " counting + coalescing + gloo ")
    scaler = ShardedGradScaler("cpu")
    assert chain_names(scaler.backend) == "counting+coalescing+gloo"
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=1.0)
    param.grad = torch.ones(2)
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()
    assert len(find_middleware(scaler.backend, CountingMiddleware).records) == 1


def test_argument_beats_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "counting+c10d")
    assert chain_names(ShardedGradScaler("cpu", backend="gloo").backend) == "gloo"
    assert chain_names(ShardedGradScaler("cpu").backend) == "counting+c10d"


def test_a_misspelled_environment_value_names_its_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "counting+glo")
    with pytest.raises(PluginNotFoundError, match=r"\$SHARDSCALE_BACKEND"):
        _ = ShardedGradScaler("cpu").backend
