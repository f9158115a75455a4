"""The host table's options and its Markdown (the run itself is ``nox -s bench_host``)."""

from __future__ import annotations

import pytest

from shardscale.cli.bench._host import HostConfig, format_host, format_host_text, main


@pytest.mark.parametrize(
    ("fields", "option"),
    [
        ({"points": ()}, "--points"),
        ({"points": (0, 10)}, "--points"),
        ({"rounds": 0}, "--rounds"),
        ({"cold_repeats": 4}, "--cold-repeats"),  # 5 at least: an interval needs samples
        ({"points": (6, 500), "cold_repeats": 7}, "--cold-repeats"),  # a rotation per sample
        ({"clock": "sun"}, "--clock"),
        ({"torch_budget_s": -1.0}, "--torch-budget"),
    ],
)
def test_a_bad_option_is_refused_naming_it(fields: dict[str, object], option: str) -> None:
    with pytest.raises(ValueError, match=option):
        HostConfig(**fields).check()  # type: ignore[arg-type]


def test_main_refuses_a_bad_option_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--rounds", "0"]) == 2
    assert "--rounds" in capsys.readouterr().err


def _interval(ratio: float) -> dict[str, float]:
    return {"ratio": ratio, "low": ratio - 0.01, "high": ratio + 0.01}


def test_the_table_has_a_row_per_point_and_says_where_torch_did_not_run() -> None:
    summary = {"min": 0.001, "median": 0.002, "max": 0.003}
    result = {
        "config": {"param_numel": 9, "world_size": 2, "clock": "cpu", "rounds": 24,
                   "cold_repeats": 3},
        "environment": {"torch": "2.13.0", "cpu_count": 2, "load_average_start": [1.0]},
        "points": [
            {"n_params": 500, "torch_cold_s": 0.9, "ours_cold": summary,
             "warm": {"torch": summary, "torch_aa": summary, "ours": summary},
             "us_per_param": {"torch": 20.0, "torch_aa": 20.0, "ours": 4.0},
             "ratio": _interval(0.2), "aa": _interval(1.0), "ours_cold_over_warm_derived": 1.5,
             "cold_over_warm": _interval(1.6)},
            {"n_params": 20000, "ours_cold": summary, "warm": {"ours": summary},
             "us_per_param": {"ours": 5.0}, "ours_cold_over_warm_derived": 1.8,
             "torch_skipped": "projected too long"},
        ],
        "growth": [{"n_params": 20000, "base": 500, "params_ratio": 40.0,
                    "time_ratio": _interval(45.0)}],
        "growth_interleaved": {"n_params": 20000, "base": 4000, "params_ratio": 5.0,
                               "time_ratio": _interval(5.2)},
    }  # fmt: skip
    plain = format_host_text(result)
    assert all(len(line) <= 120 for line in plain.splitlines()), plain
    lines = plain.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("params"))
    assert lines[head + 1].startswith("------")
    assert lines[head + 2].split()[:2] == ["500", "0.90"] and "0.20 [0.19, 0.21]" in lines[head + 2]
    assert lines[head + 3].split()[:2] == ["20000", "skipped"] and lines[head + 3].endswith("1.80")
    assert "20000: projected too long" in plain
    text = format_host(result)
    rows = [line for line in text.splitlines() if line.startswith("| 500 ") or
            line.startswith("| 20000 ")]  # fmt: skip
    assert len(rows) == 2
    assert "0.20 [0.19, 0.21]" in rows[0] and "skipped" in rows[1]
    # Cold / warm: the interval where the run has one, the bare ratio from an older run.
    assert rows[0].endswith("| 1.60 [1.59, 1.61] |") and rows[1].endswith("| 1.80 |")
    assert "20000: projected too long" in text and "45.00 [44.99, 45.01]" in text
    assert "same rounds: 5.20 [5.19, 5.21] (paired interval)" in text
