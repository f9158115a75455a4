"""What a session promises whatever else is set: a bad variable, a shared path, a missing rank.

* a misspelt ``SHARDSCALE_TELEMETRY`` turns off the environment's session only:
  sessions started in code keep every row, and the variable stays a named
  failure of the telemetry plugin;
* several writing ranks cannot share one file: ``enable`` refuses a path
  without ``{rank}`` with the variable's own words, and starts nothing;
* a selected rank that the run does not have is a warning, not silence.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from shardscale import telemetry
from shardscale.core import PluginWarning, get_registry
from shardscale.telemetry import (
    JsonlObserver,
    TelemetryConfigError,
    TensorBoardObserver,
    parse_spec,
)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# -- a bad variable leaves sessions made in code alone ----------------------------------------


def test_a_bad_variable_does_not_silence_a_session_started_in_code(
    loop: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(telemetry.ENV, f"tensorbord:{tmp_path}/tb")
    session = telemetry.enable(JsonlObserver(tmp_path / "code.jsonl"), flush_every=2)
    with pytest.warns(PluginWarning, match=r"unknown observer 'tensorbord'"):
        first = loop.train(3, poison=frozenset({1}))
    second = loop.train(2)  # later steps too: the plugin was not set aside
    session.close()
    rows = _lines(tmp_path / "code.jsonl")
    assert [r["scale"] for r in rows] == first.scales + second.scales
    assert [r["skipped"] for r in rows] == first.skipped + second.skipped
    # The variable is still a named failure of the telemetry plugin, with its own fix, once.
    failures = [f for f in get_registry().failures() if f.distribution == "shardscale-telemetry"]
    assert len(failures) == 1, failures
    assert failures[0].name == "telemetry" and failures[0].stage == "observer"
    assert "tensorbord" in failures[0].error and "correct SHARDSCALE_TELEMETRY" in failures[0].fix
    assert not (tmp_path / "tb").exists()


def test_a_code_session_enabled_after_the_bad_variable_was_read_still_writes(
    loop: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(telemetry.ENV, "jsonl:a.jsonl,every=-1")
    with pytest.warns(PluginWarning, match=r"every='-1'"):
        loop.train(2)
    with telemetry.enable(JsonlObserver(tmp_path / "late.jsonl"), flush_every=1):
        truth = loop.train(3)
    assert [r["scale"] for r in _lines(tmp_path / "late.jsonl")] == truth.scales


# -- several writers, one file: refused as the variable refuses it ----------------------------


@pytest.mark.parametrize("ranks", ["all", [0, 1]])
@pytest.mark.parametrize(
    ("make", "spec"),
    [
        (lambda d: JsonlObserver(f"{d}/steps.jsonl"), "jsonl:{d}/steps.jsonl"),
        (lambda d: TensorBoardObserver(f"{d}/tb"), "tensorboard:{d}/tb"),
    ],
)
def test_a_path_shared_by_several_writing_ranks_is_refused_like_the_variable(
    tmp_path: Path, make: Any, spec: str, ranks: Any
) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    with pytest.raises(TelemetryConfigError) as in_code:
        telemetry.enable(make(tmp_path), ranks=ranks)
    with pytest.raises(TelemetryConfigError) as in_env:
        parse_spec(spec.format(d=tmp_path) + ",ranks=all")
    # The variable's words, after "SHARDSCALE_TELEMETRY='...': ", up to its example.
    env_text = str(in_env.value).split("': ", 1)[1].rsplit(". Example: ", 1)[0]
    code_text = str(in_code.value)
    if ranks == "all":
        assert code_text.endswith(env_text), (code_text, env_text)
    else:
        assert code_text.endswith(env_text.replace("ranks=all", "ranks=[0, 1]"))
    assert "must contain {rank}" in code_text and "rank{rank}" in code_text
    # Nothing started: no session, no file or folder, no signal handler.
    assert telemetry.sessions() == ()
    assert list(tmp_path.iterdir()) == []
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_path_with_rank_is_fine_for_every_rank(loop: Any, tmp_path: Path) -> None:
    with telemetry.enable(JsonlObserver(tmp_path / "s.{rank}.jsonl"), ranks="all"):
        loop.train(2)
    assert len(_lines(tmp_path / "s.0.jsonl")) == 2


# -- a rank the run does not have -------------------------------------------------------------


@pytest.mark.parametrize("via", ["enable", "variable"])
def test_a_rank_outside_the_world_warns_with_the_world_size_and_the_fix(
    loop: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    path = tmp_path / "s.jsonl"
    if via == "enable":
        telemetry.enable(JsonlObserver(path), ranks=5, flush_every=1)
    else:
        monkeypatch.setenv(telemetry.ENV, f"jsonl:{path},ranks=5,every=1")
    with pytest.warns(RuntimeWarning) as caught:
        loop.train(3)
    said = [str(w.message) for w in caught if "selects rank 5" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]  # once, not per step
    assert "world size 1" in said[0] and "nothing is written" in said[0]
    assert "ranks=0" in said[0]
    assert not path.exists()


def test_an_existing_rank_of_a_larger_world_does_not_warn(
    loop: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with telemetry.enable(JsonlObserver(tmp_path / "s.jsonl"), ranks=5):
        loop.train(2)
    assert not [w for w in recwarn if "selects rank" in str(w.message)]
    assert not os.path.exists(tmp_path / "s.jsonl")  # rank 0 is not rank 5
