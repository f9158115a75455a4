"""The TensorBoard observer's event files, read back with tensorboard's own EventAccumulator."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from shardscale import telemetry
from shardscale.telemetry import TENSORBOARD_TAGS, TelemetryConfigError, TensorBoardObserver

pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")

from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every value
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_one_scalar_per_step_per_tag_with_the_scaler_values(loop: Any, tmp_path: Path) -> None:
    poison = frozenset({0, 4})
    with telemetry.enable(TensorBoardObserver(tmp_path / "tb"), flush_every=4):
        truth = loop.train(9, poison=poison, init_scale=4096.0, growth_interval=2)
    got = _scalars(tmp_path / "tb")
    assert set(got) == {f"shardscale/{t}" for t in TENSORBOARD_TAGS}
    steps = list(range(1, 10))
    for tag, values in got.items():
        assert [s for s, _ in values] == steps, tag
    # float32 in the event file: the scales are powers of two, exact.
    assert [v for _, v in got["shardscale/scale"]] == truth.scales
    by_hand = loop.expected_scales(9, poison, init=4096.0, interval=2)
    assert [v for _, v in got["shardscale/growth_tracker"]] == [t for _, t in by_hand]
    assert [v for _, v in got["shardscale/skipped"]] == [float(s) for s in truth.skipped]
    assert [v for _, v in got["shardscale/skipped_total"]] == [1, 1, 1, 1, 2, 2, 2, 2, 2]
    assert [v for _, v in got["shardscale/overflow_ranks"]] == [float(s) for s in truth.skipped]
    for (_, v), norm, skipped in zip(got["shardscale/grad_norm"], truth.norms, truth.skipped,
                                     strict=True):  # fmt: skip
        if skipped:
            assert not math.isfinite(v)
        else:
            # The event file stores float32; the norm is float32 already.
            assert v == norm


def test_rank_placeholder_and_no_file_before_a_write(loop: Any, tmp_path: Path) -> None:
    session = telemetry.enable(TensorBoardObserver(tmp_path / "tb" / "rank{rank}"), flush_every=5)
    loop.train(3)
    assert not (tmp_path / "tb").exists()  # nothing touched before the first flush
    session.close()
    assert [s for s, _ in _scalars(tmp_path / "tb" / "rank0")["shardscale/scale"]] == [1, 2, 3]


def test_log_dir_that_is_a_file_drops_the_observer_with_a_warning(
    loop: Any, tmp_path: Path
) -> None:
    (tmp_path / "tb").write_text("not a folder")
    with (
        pytest.warns(RuntimeWarning, match="is a file"),
        telemetry.enable(TensorBoardObserver(tmp_path / "tb"), flush_every=1),
    ):
        loop.train(2)


def test_bad_prefix() -> None:
    with pytest.raises(TelemetryConfigError, match="prefix"):
        TensorBoardObserver("tb", prefix=3)  # type: ignore[arg-type]
