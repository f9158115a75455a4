"""``shardscale plugins`` lists observers: shardscale-telemetry's three, and any other observer plugin."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shardscale.cli._app import main
from shardscale.core import StepRecord, get_registry, hookimpl
from shardscale.core.plugins import reset_registry


class _ThirdPartyObserver:
    @hookimpl
    def shardscale_on_step(self, record: StepRecord) -> None:
        pass


def _observers(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {ob["name"]: ob for ob in data["observers"]}


def test_telemetry_observers_and_an_in_process_observer_are_listed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from shardscale.telemetry import observer_kinds

    reset_registry()
    reg = get_registry()
    name = reg.register(_ThirdPartyObserver(), name="my-observer")
    try:
        assert main(["plugins", "--json"]) == 0
        observers = _observers(json.loads(capsys.readouterr().out))
        for kind in ("jsonl", "tensorboard", "wandb"):
            ob = observers[kind]
            assert ob["distribution"] == "shardscale-telemetry" and ob["plugin"] == "telemetry"
            # Usable exactly when its library imports here (the extras are optional).
            assert ob["usable"] is (observer_kinds()[kind] is None)
            assert "SHARDSCALE_TELEMETRY" in ob["note"]
        assert observers["jsonl"]["usable"] is True
        assert observers["my-observer"]["distribution"] == "<in-process>"
        assert main(["plugins"]) == 0
        table = [line.split() for line in capsys.readouterr().out.splitlines()]
        rows = {cells[0]: cells for cells in table if len(cells) > 2 and cells[1] == "observer"}
        assert set(rows) >= {"jsonl", "tensorboard", "wandb", "my-observer"}
        assert rows["jsonl"][3] == "shardscale-telemetry" and rows["jsonl"][5] == "yes"
    finally:
        reg.unregister(name)
        reset_registry()
