"""The benchmark's progress: rank 0's event file and the parent's plain view (no terminal)."""

from __future__ import annotations

import io
from pathlib import Path

from shardscale.cli.bench._progress import ProgressFile, ProgressView, format_seconds, read_events


def test_only_rank_zero_writes_and_a_half_written_line_waits(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    ProgressFile(str(path), enabled=False).event("rows", label="x", done=1, total=2)
    assert not path.exists()
    ProgressFile(str(path), enabled=True).event("rows", label="dp2 sgd: warm-up", done=0, total=4)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write('{"task": "rows", "lab')  # a line still being written
    events, offset = read_events(path, 0)
    assert [e["label"] for e in events] == ["dp2 sgd: warm-up"]
    with open(path, "a", encoding="utf-8") as fh:
        fh.write('el": "dp2 sgd: round 1/4", "done": 1, "total": 4, "budget_s": null}\n')
    events, offset = read_events(path, offset)
    assert [e["label"] for e in events] == ["dp2 sgd: round 1/4"]
    assert read_events(path, offset) == ([], offset)


def test_plain_view_prints_each_new_part_and_throttles_rounds_with_an_estimate() -> None:
    now = [0.0]
    out = io.StringIO()
    view = ProgressView({"rows": "timed rounds"}, stream=out, use_rich=False, clock=lambda: now[0])

    def ev(label: str, done: int, total: int = 10) -> dict[str, object]:
        return {"task": "rows", "label": label, "done": done, "total": total}

    with view:
        view.show([ev("dp2 sgd: warm-up", 0)])
        now[0] = 2.0
        view.show([ev("dp2 sgd: round 1/4", 1)])  # same part, 2 s later: not printed
        now[0] = 10.0
        view.show([ev("dp2 adam_fused: warm-up", 5)])  # a new part: printed, with an estimate
        now[0] = 45.0
        view.show([ev("dp2 adam_fused: round 3/4", 8)])  # 35 s later: printed again
        now[0] = 50.0
        view.show([ev("dp2 adam_fused: done", 10)])  # same part, 5 s later: at the end
    lines = out.getvalue().splitlines()
    assert lines == [
        "  timed rounds 0/10: dp2 sgd: warm-up (0 s so far)",
        "  timed rounds 5/10: dp2 adam_fused: warm-up (10 s so far, about 10 s left)",
        "  timed rounds 8/10: dp2 adam_fused: round 3/4 (45 s so far, about 11 s left)",
        "  timed rounds 10/10: dp2 adam_fused: done (50 s so far, about 0 s left)",
    ]
    view.close()  # twice: nothing more
    assert len(out.getvalue().splitlines()) == 4
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_a_budgeted_task_never_estimates_past_its_budget() -> None:
    now = [0.0]
    out = io.StringIO()
    view = ProgressView({"scaling": "scaling table"}, stream=out, use_rich=False,
                        clock=lambda: now[0])  # fmt: skip
    with view:
        view.show([{"task": "scaling", "label": "250 parameters", "done": 0, "total": 5,
                    "budget_s": 100.0}])  # fmt: skip
        now[0] = 60.0
        view.show([{"task": "scaling", "label": "500 parameters", "done": 1, "total": 5,
                    "budget_s": 100.0}])  # fmt: skip
    # 60 s per point would be 240 s more; the budget leaves 40.
    assert out.getvalue().splitlines()[-1].endswith("(1 min 00 s so far, about 40 s left)")
    assert format_seconds(3725) == "62 min 05 s" and format_seconds(float("nan")) == "?"
