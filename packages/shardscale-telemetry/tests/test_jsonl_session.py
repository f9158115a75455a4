"""The JSONL observer and telemetry sessions, fed by a real ShardedGradScaler loop."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from shardscale import telemetry
from shardscale.core import PluginWarning, get_registry
from shardscale.core.testing import HostReadRecorder
from shardscale.telemetry import JsonlObserver, StepRow, TelemetryConfigError


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_installed_but_not_enabled_writes_nothing(
    loop: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    loop.train(4, poison=frozenset({1}))
    assert list(tmp_path.iterdir()) == [] and telemetry.sessions() == ()


def test_one_line_per_step_matches_what_the_scaler_did(loop: Any, tmp_path: Path) -> None:
    poison = frozenset({1, 5, 6})
    path = tmp_path / "deep" / "steps.jsonl"
    session = telemetry.enable(JsonlObserver(path), flush_every=4)
    truth = loop.train(10, poison=poison, init_scale=1024.0, growth_interval=3)
    session.close()
    lines = _lines(path)
    assert [ln["step"] for ln in lines] == list(range(1, 11))
    assert [ln["scale"] for ln in lines] == truth.scales
    by_hand = loop.expected_scales(10, poison, init=1024.0, interval=3)
    assert [(ln["scale"], ln["growth_tracker"]) for ln in lines] == by_hand
    assert [ln["skipped"] for ln in lines] == truth.skipped
    for ln, norm in zip(lines, truth.norms, strict=True):
        # Skipped steps have an inf norm, written as null (strict JSON); others exactly.
        assert ln["grad_norm"] == (norm if math.isfinite(norm) else None)
        assert ln["rank"] == 0 and ln["hysteresis_tracker"] == 1
        # Single process: rank 0 is the one that overflowed, with the one poisoned gradient.
        assert (ln["overflow_ranks"], ln["overflow_counts"]) == (
            ([0], [1]) if ln["skipped"] else ([], [])
        )
    assert lines == sorted(lines, key=lambda ln: ln["time"])


def test_hysteresis_tracker_is_recorded(loop: Any, tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    with telemetry.enable(JsonlObserver(path), flush_every=100):
        loop.train(5, poison=frozenset({1, 2}), hysteresis=2, growth_interval=100)
    lines = _lines(path)
    # hysteresis=2: the first overflow only spends the tracker, the second backs off.
    assert [ln["hysteresis_tracker"] for ln in lines] == [2, 1, 1, 2, 2]
    assert [ln["scale"] for ln in lines] == [1024.0, 1024.0, 512.0, 512.0, 512.0]


def test_flush_every_and_close(loop: Any, tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    session = telemetry.enable(JsonlObserver(path), flush_every=3)
    loop.train(7)
    # 7 steps, flushed at 3 and 6: the 7th is still on the device.
    assert len(_lines(path)) == 6 and session.rows_written == 6
    telemetry.flush()
    assert len(_lines(path)) == 7
    session.close()
    session.close()  # idempotent
    assert session.closed and telemetry.sessions() == ()
    loop.train(2)  # a closed session records nothing more
    assert len(_lines(path)) == 7


def test_not_a_writing_rank_writes_nothing(
    loop: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0 of a 2-process launch (no process group: the launcher's variables say so).
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with telemetry.enable(JsonlObserver(tmp_path / "s.jsonl"), ranks=1, flush_every=1):
        loop.train(3)
    assert not (tmp_path / "s.jsonl").exists()


def test_rank_placeholder(loop: Any, tmp_path: Path) -> None:
    with telemetry.enable(JsonlObserver(tmp_path / "s.{rank}.jsonl"), ranks="all"):
        loop.train(2)
    assert len(_lines(tmp_path / "s.0.jsonl")) == 2


def test_append(loop: Any, tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    with telemetry.enable(JsonlObserver(path)):
        loop.train(2)
    with telemetry.enable(JsonlObserver(path)):
        loop.train(3)
    assert len(_lines(path)) == 3  # replaced
    with telemetry.enable(JsonlObserver(path, append=True)):
        loop.train(2)
    assert [ln["step"] for ln in _lines(path)] == [1, 2, 3, 1, 2]


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (telemetry.enable, "at least one observer"),
        (lambda: telemetry.enable(JsonlObserver("a"), flush_every=0), "flush_every"),
        (lambda: telemetry.enable(JsonlObserver("a"), flush_every=True), "flush_every"),
        (lambda: telemetry.enable(JsonlObserver("a"), ranks=-1), "ranks must name"),
        (lambda: telemetry.enable(JsonlObserver("a"), ranks="rank0"), "ranks must be"),
        (lambda: telemetry.enable("jsonl:a"), "is not an observer"),  # type: ignore[arg-type]
        (lambda: JsonlObserver(3), "takes a path"),  # type: ignore[arg-type]
        (lambda: JsonlObserver(""), "empty path"),
        (lambda: JsonlObserver("a{step}.jsonl"), "only the placeholder {rank}"),
    ],
)
def test_bad_arguments_raise_and_start_nothing(call: Any, needle: str) -> None:
    with pytest.raises(TelemetryConfigError, match=None) as info:
        call()
    assert needle in str(info.value)
    assert telemetry.sessions() == ()


class _Broken:
    def __init__(self) -> None:
        self.closed = False

    def open(self, rank: int) -> None:
        pass

    def write(self, rows: Sequence[StepRow]) -> None:
        raise OSError("disk full")

    def close(self) -> None:
        self.closed = True


def test_a_failing_observer_is_dropped_with_a_warning_and_others_keep_writing(
    loop: Any,
    tmp_path: Path,
) -> None:
    broken = _Broken()
    session = telemetry.enable(broken, JsonlObserver(tmp_path / "s.jsonl"), flush_every=2)
    with pytest.warns(RuntimeWarning, match=r"failed in write\(\).*OSError: disk full"):
        loop.train(4)
    assert broken.closed and len(session.observers) == 1
    session.close()
    assert len(_lines(tmp_path / "s.jsonl")) == 4


def test_environment_variable_turns_it_on(
    loop: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(telemetry.ENV, f"jsonl:{tmp_path}/env.jsonl,every=2")
    truth = loop.train(5, poison=frozenset({0}))
    (session,) = telemetry.sessions()
    assert session.flush_every == 2
    telemetry.close_all()
    assert [ln["scale"] for ln in _lines(tmp_path / "env.jsonl")] == truth.scales


def test_bad_environment_variable_is_a_named_plugin_failure_and_training_goes_on(
    loop: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A bad SHARDSCALE_TELEMETRY is found at the first update, after the scale has moved:
    # raising there would leave the step half done. The registry sets the observer aside
    # with a warning that names the variable and the fix; training is not disturbed.
    monkeypatch.setenv(telemetry.ENV, "jsonl:a.jsonl,every=-1")
    with pytest.warns(PluginWarning, match=r"SHARDSCALE_TELEMETRY='jsonl:a.jsonl,every=-1'"):
        truth = loop.train(3)
    expected = loop.expected_scales(3, frozenset(), init=1024.0, interval=3)
    assert truth.scales == [scale for scale, _ in expected]  # every step ran, as without telemetry
    assert truth.skipped == [False] * 3
    assert telemetry.sessions() == ()
    failures = [f for f in get_registry().failures() if f.distribution == "shardscale-telemetry"]
    assert len(failures) == 1 and "every='-1'" in failures[0].error
    assert not (Path.cwd() / "a.jsonl").exists()


def test_env_session_flushes_at_interpreter_exit(tmp_path: Path) -> None:
    # A real process: the atexit flush, with nothing closed by the program.
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from conftest import train; train(7, poison=frozenset({2}))"
    )
    env = dict(os.environ, **{telemetry.ENV: f"jsonl:{tmp_path}/exit.jsonl,every=5"})
    subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)], env=env,
                   check=True, timeout=120)  # fmt: skip
    lines = _lines(tmp_path / "exit.jsonl")
    assert [ln["step"] for ln in lines] == list(range(1, 8))
    assert [ln["skipped"] for ln in lines] == [s == 3 for s in range(1, 8)]


# -- no host read per step ------------------------------------------------------------------


def _fused_loop(steps: int) -> list[int]:
    # A fused optimizer: the scaler's own step makes no host read, so any read is telemetry's.
    from shardscale.core import ShardedGradScaler

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = ShardedGradScaler("cpu", init_scale=256.0, backend="local")
    per_step = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        scaler.scale(model(torch.randn(2, 6)).sum()).backward()
        with HostReadRecorder() as reads:
            scaler.unscale_(opt, max_norm=1.0)
            scaler.step(opt)
            scaler.update()
        per_step.append(len(reads.seen) if step else 0)  # step 0: the one-time chain check
    return per_step


class _ItemObserver:
    """What users write by hand: a Python number per step."""

    @staticmethod
    def open(rank: int) -> None: ...
    @staticmethod
    def write(rows: Sequence[StepRow]) -> None: ...
    @staticmethod
    def close() -> None: ...


def test_no_host_read_per_step_one_tolist_per_flush(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    callers: list[str] = []
    original = torch.Tensor.tolist

    def counting_tolist(self: torch.Tensor) -> Any:
        # tolist() is no dispatcher op: count its callers by module instead.
        callers.append(sys._getframe(1).f_globals["__name__"])
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    assert _fused_loop(6) == [0] * 6  # the baseline: no host read at all
    baseline, callers[:] = list(callers), []
    with telemetry.enable(JsonlObserver(tmp_path / "s.jsonl"), flush_every=3):
        assert _fused_loop(6) == [0] * 6  # telemetry on: still none, flushes included
    # 6 steps, flush_every=3: exactly two reads of the whole buffer, nothing else added.
    ours = [c for c in callers if c.startswith("shardscale.telemetry")]
    assert ours == ["shardscale.telemetry._rows"] * 2
    assert sorted(c for c in callers if c not in ours) == sorted(baseline)
    assert len(_lines(tmp_path / "s.jsonl")) == 6


def test_the_detector_sees_a_per_step_item() -> None:
    # The count above can fail: an observer that calls .item() per step is seen.
    from shardscale.core import StepRecord, get_registry, hookimpl

    class PerStepItem:
        @hookimpl
        def shardscale_on_step(self, record: StepRecord) -> None:
            record.scale.item()

    reg = get_registry()
    name = reg.register(PerStepItem(), name="per-step-item")
    try:
        assert _fused_loop(3)[1:] == [1, 1]
    finally:
        reg.unregister(name)
