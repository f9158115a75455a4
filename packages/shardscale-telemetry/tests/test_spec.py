"""SHARDSCALE_TELEMETRY: what it accepts, and a clear error for everything else."""

from __future__ import annotations

import pytest

from shardscale.telemetry import (
    ENV,
    SinkSpec,
    TelemetryConfigError,
    TelemetrySpec,
    parse_spec,
)


@pytest.mark.parametrize("text", ["", "   ", "off", "OFF"])
def test_empty_or_off_is_off(text: str) -> None:
    assert parse_spec(text) is None


def test_full_spec() -> None:
    spec = parse_spec(" jsonl:runs/a.jsonl , tensorboard:runs/tb,wandb:proj,every=7 ")
    assert spec == TelemetrySpec(
        (SinkSpec("jsonl", "runs/a.jsonl"), SinkSpec("tensorboard", "runs/tb"),
         SinkSpec("wandb", "proj")),
        flush_every=7,
        ranks=0,
    )  # fmt: skip


def test_defaults_and_bare_wandb() -> None:
    spec = parse_spec("wandb")
    assert spec == TelemetrySpec((SinkSpec("wandb", None),), flush_every=100, ranks=0)


def test_ranks() -> None:
    spec = parse_spec("jsonl:s.{rank}.jsonl,ranks=all")
    assert spec is not None and spec.ranks == "all"
    spec = parse_spec("jsonl:s.jsonl,ranks=3")
    assert spec is not None and spec.ranks == 3


def test_paths_keep_colons_and_equals() -> None:
    spec = parse_spec("jsonl:/data/a=b:c.jsonl")
    assert spec is not None and spec.sinks == (SinkSpec("jsonl", "/data/a=b:c.jsonl"),)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("tensorbord:runs/tb", "unknown observer 'tensorbord'"),
        ("jsonl", "jsonl needs a file path"),
        ("tensorboard:", "tensorboard needs a folder"),
        ("jsonl:a,every=0", "every='0' must be a whole number"),
        ("jsonl:a,every=ten", "every='ten'"),
        ("jsonl:a,ranks=first", "ranks='first' must be 'all'"),
        ("jsonl:a,colour=red", "unknown option 'colour'"),
        ("jsonl:a,,tensorboard:b", "an empty entry"),
        ("jsonl:a,", "an empty entry"),
        ("every=5", "options but no observer"),
        ("jsonl:a,jsonl:b", "jsonl is given twice"),
        ("jsonl:a,every=2,every=3", "every= is given twice"),
        ("jsonl:steps.jsonl,ranks=all", "must contain {rank} (e.g. 'steps.rank{rank}.jsonl')"),
        ("tensorboard:runs/tb,ranks=all", "must contain {rank} (e.g. 'runs/tb/rank{rank}')"),
    ],
)
def test_bad_values_name_the_problem_and_a_fix(text: str, needle: str) -> None:
    with pytest.raises(TelemetryConfigError) as info:
        parse_spec(text)
    message = str(info.value)
    assert needle in message
    assert message.startswith(f"{ENV}={text!r}") and "Example: " in message
