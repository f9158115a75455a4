"""The end-of-run report: ``metrics.json``, a summary table and the PNG plot.

Written by rank 0 of the training script; ``shardscale demo`` reads the same
file to draw the report in the launching process.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from shardscale.cli._ui import UI_EXTRA_HINT, have_matplotlib, print_table

__all__ = [
    "METRICS_FILE",
    "STEPS_FILE",
    "PLOT_FILE",
    "LOGS_DIR",
    "result_file",
    "output_files",
    "finite_or_none",
    "scale_changes",
    "skipped_text",
    "write_json",
    "render_report",
]

METRICS_FILE = "metrics.json"
#: The scaler's per-step telemetry (shardscale.telemetry's JSONL observer), written by rank 0.
STEPS_FILE = "steps.jsonl"
PLOT_FILE = "training.png"
LOGS_DIR = "logs"


def result_file(out_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its final loss and parameter hash."""
    return out_dir / f"result-rank{rank}.json"


def output_files(out_dir: Path, *, logs: bool) -> list[Path]:
    """The files a run writes in ``out_dir`` that exist now (left-overs of an earlier run).

    ``logs`` adds ``logs/rank*`` (the demo's per-rank logs and progress files).
    Half-written ``*.tmp`` files count too. Nothing else in the folder is listed.
    """
    patterns = [METRICS_FILE, STEPS_FILE, PLOT_FILE, "result-rank*.json", "*.json.tmp"]
    if logs:
        patterns += [f"{LOGS_DIR}/rank*.log", f"{LOGS_DIR}/rank*.progress*"]
    found: list[Path] = []
    for pattern in patterns:
        found += [p for p in sorted(out_dir.glob(pattern)) if p.is_file()]
    return found


def finite_or_none(doc: Any) -> Any:
    """``doc`` with every non-finite float (nan, inf, -inf) replaced by ``None``.

    [Note: non-finite numbers in JSON]
    Strict JSON has no NaN or Infinity, and a diverged run has a nan loss, an
    overflowed step an inf gradient norm. Every file and event the demo writes
    stores them as ``null`` ("no finite value"); readers treat ``null`` as
    not-a-number. Which non-finite value it was is not kept: for a loss or a
    norm the difference carries no meaning a reader could act on. The one
    non-finite setting, ``max_norm = inf`` (measure, never clip), is also
    ``null`` in the ``config`` section: read it as "no clipping".
    """
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if isinstance(doc, Mapping):
        return {k: finite_or_none(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [finite_or_none(v) for v in doc]
    return doc


def write_json(path: Path, doc: Mapping[str, Any]) -> Path:
    """Write strict JSON (non-finite numbers as ``null``) atomically enough for a polling reader."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    text = json.dumps(finite_or_none(doc), indent=2, allow_nan=False)
    tmp.write_text(text + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def _num(value: Any) -> float:
    # null in the JSON is a non-finite value (see [Note: non-finite numbers in JSON]).
    return float("nan") if value is None else float(value)


def _fmt(value: Any, spec: str) -> str:
    number = _num(value)
    return format(number, spec) if math.isfinite(number) else "nan"


def scale_changes(scales: list[float]) -> tuple[int, int]:
    """``(backoffs, growths)``: how often the loss scale went down and up between steps."""
    pairs = list(itertools.pairwise(scales))
    return sum(b < a for a, b in pairs), sum(b > a for a, b in pairs)


def skipped_text(summary: Mapping[str, Any]) -> str:
    """``"10: 8 overflow, 2 spike"``: how many steps were skipped, and for which reasons."""
    total = int(summary["skipped_steps"])
    reasons: Mapping[str, int] = summary.get("skip_reasons") or {}
    if not total or not reasons:
        return str(total)
    return f"{total}: " + ", ".join(f"{n} {why}" for why, n in sorted(reasons.items()))


def _window_mean(values: list[float], *, head: bool) -> float:
    # Mean of the first/last tenth (at most 10 steps); nan if any of them is nan.
    k = max(1, min(10, len(values) // 5 or 1))
    part = values[:k] if head else values[-k:]
    return sum(part) / len(part) if part else float("nan")


def render_report(
    doc: Mapping[str, Any], out_dir: Path, *, stream: TextIO, plot: bool = True
) -> Path | None:
    """Print the summary table for a ``metrics.json`` document and draw the plot.

    Returns the PNG path, or ``None`` when matplotlib is not installed (a hint
    saying how to get it is printed instead).
    """
    run, summary, history = doc["run"], doc["summary"], doc["history"]
    losses = [_num(h["loss"]) for h in history]
    norms = [float(h["grad_norm"]) for h in history if h["grad_norm"] is not None]
    scales = [_num(h["scale"]) for h in history]
    if summary.get("final_scale") is not None:
        scales.append(float(summary["final_scale"]))  # the update after the last step
    backoffs, growths = scale_changes(scales)
    chars = run["tokens_per_step"] * len(history)
    rows = [
        ("model", f"decoder-only transformer, {run['parameters'] / 1e6:.2f} M parameters"),
        ("corpus", run["corpus"]),
        ("ranks / mesh", f"{run['world_size']} / {run['mesh_desc']}"),
        ("device / precision", f"{run['device']} / {run['precision']} autocast"),
        ("collective backend", run["backend"]),
        ("steps (skipped: why)", f"{len(history)} ({skipped_text(summary)})"),
        (
            "loss: first -> last",
            f"{_fmt(_window_mean(losses, head=True), '.3f')} -> "
            f"{_fmt(_window_mean(losses, head=False), '.3f')}",
        ),
        ("held-out loss", _fmt(summary["held_out_loss"], ".3f")),
        (
            "loss scale: first -> final",
            f"{_fmt(scales[0] if scales else None, 'g')} -> {_fmt(summary['final_scale'], 'g')} "
            f"({backoffs} backoffs, {growths} growths)",
        ),
        ("grad norm (median, pre-clip)", f"{statistics.median(norms):.3f}" if norms else "n/a"),
        (
            "wall time",
            f"{_num(summary['wall_s']):.1f} s in training "
            f"({chars / max(_num(summary['wall_s']), 1e-9):,.0f} chars/s)",
        ),
        ("parameters sha256", summary["params_sha256"][:16] + "..."),
    ]
    print_table("shardscale demo: summary", rows, headers=("", ""), stream=stream)
    if summary.get("first_overflow"):
        print("\nfirst skipped step, from scaler.overflow_report(model):", file=stream)
        print(summary["first_overflow"].rstrip(), file=stream)
    if summary.get("sample"):
        print("\nsample from the trained model:\n" + summary["sample"].rstrip() + "\n", file=stream)
    print(f"metrics: {out_dir / METRICS_FILE}", file=stream)
    if not plot:
        return None
    if not have_matplotlib():
        print(
            f"no plot: matplotlib is not installed ({UI_EXTRA_HINT} to get the plot and the "
            "rich progress bar)",
            file=stream,
        )
        return None
    from shardscale.cli._plots import plot_training

    finite_last = next((v for v in reversed(losses) if math.isfinite(v)), float("nan"))
    path = plot_training(
        [{**h, "loss": _num(h["loss"])} for h in history],
        out_dir / PLOT_FILE,
        title=f"shardscale demo: {run['world_size']} ranks ({run['mesh_desc']}), "
        f"{run['precision']}, final loss {finite_last:.3f}",
        max_norm=doc.get("config", {}).get("max_norm"),
    )
    print(f"plot: {path}", file=stream, flush=True)
    return path
