"""The end-of-run report: ``metrics.json``, a summary table and the PNG plot.

Written by rank 0 of the training script; ``shardscale demo`` reads the same
file to draw the report in the launching process.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from shardscale.cli._ui import UI_EXTRA_HINT, have_matplotlib, print_table

__all__ = ["METRICS_FILE", "PLOT_FILE", "result_file", "write_json", "render_report"]

METRICS_FILE = "metrics.json"
PLOT_FILE = "training.png"


def result_file(out_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its final loss and parameter hash."""
    return out_dir / f"result-rank{rank}.json"


def write_json(path: Path, doc: Mapping[str, Any]) -> Path:
    """Write strict JSON (no NaN/Infinity) atomically enough for a reader polling the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def _window_mean(values: list[float], *, head: bool) -> float:
    k = max(1, min(10, len(values) // 5 or 1))
    part = values[:k] if head else values[-k:]
    return sum(part) / len(part)


def render_report(
    doc: Mapping[str, Any], out_dir: Path, *, stream: TextIO, plot: bool = True
) -> Path | None:
    """Print the summary table for a ``metrics.json`` document and draw the plot.

    Returns the PNG path, or ``None`` when matplotlib is not installed (a hint
    saying how to get it is printed instead).
    """
    run, summary, history = doc["run"], doc["summary"], doc["history"]
    losses = [float(h["loss"]) for h in history]
    norms = [float(h["grad_norm"]) for h in history if h["grad_norm"] is not None]
    chars = run["tokens_per_step"] * len(history)
    rows = [
        ("model", f"decoder-only transformer, {run['parameters'] / 1e6:.2f} M parameters"),
        ("corpus", run["corpus"]),
        ("ranks / mesh", f"{run['world_size']} / {run['mesh_desc']}"),
        ("device / precision", f"{run['device']} / {run['precision']} autocast"),
        ("collective backend", run["backend"]),
        ("steps (skipped: overflow)", f"{len(history)} ({summary['skipped_steps']})"),
        (
            "loss: first -> last",
            f"{_window_mean(losses, head=True):.3f} -> {_window_mean(losses, head=False):.3f}",
        ),
        ("held-out loss", f"{summary['held_out_loss']:.3f}"),
        ("final loss scale", f"{summary['final_scale']:g}"),
        ("grad norm (median, pre-clip)", f"{statistics.median(norms):.3f}" if norms else "n/a"),
        (
            "wall time",
            f"{summary['wall_s']:.1f} s ({chars / max(summary['wall_s'], 1e-9):,.0f} chars/s)",
        ),
        ("parameters sha256", summary["params_sha256"][:16] + "..."),
    ]
    print_table("shardscale demo: summary", rows, headers=("", ""), stream=stream)
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
        history,
        out_dir / PLOT_FILE,
        title=f"shardscale demo: {run['world_size']} ranks ({run['mesh_desc']}), "
        f"{run['precision']}, final loss {finite_last:.3f}",
        max_norm=doc.get("config", {}).get("max_norm"),
    )
    print(f"plot: {path}", file=stream, flush=True)
    return path
