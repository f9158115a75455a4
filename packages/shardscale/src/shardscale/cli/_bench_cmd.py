"""``shardscale bench``: shardscale-clip's benchmark as a command, plus a PNG bar chart.

The measuring is :func:`shardscale.clip._bench.run_benchmark` (torch's
``unscale_`` + ``clip_grad_norm_`` against ``unscale_and_clip_``, side by side
in one run); this module only forwards options, prints the table, keeps the
JSON and draws the chart from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

__all__ = ["BENCH_JSON", "BENCH_PNG", "add_bench_parser", "plot_bench_json", "run_bench"]

BENCH_JSON = "bench.json"
BENCH_PNG = "bench.png"


def add_bench_parser(sub: Any) -> argparse.ArgumentParser:
    """Register the ``bench`` subcommand."""
    p: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="time unscale_and_clip_ against torch's unscale_ + clip_grad_norm_",
        description="Run shardscale-clip's benchmark: an FSDP2 model post-processed with torch's "
        "recipe and with shardscale's, alternating steps in one run. Prints the side-by-side "
        "table, writes bench.json and a bench.png bar chart of the ratios to torch.",
    )
    p.add_argument("--world-size", type=int, default=2, help="processes (default 2)")
    p.add_argument("--steps", type=int, default=5, help="timed whole training steps per recipe")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=15,
                   help="timed post-processing repeats per step (the median is reported)")  # fmt: skip
    p.add_argument("--width", type=int, default=1024, help="model width")
    p.add_argument("--hidden", type=int, default=4096, help="MLP hidden size")
    p.add_argument("--blocks", type=int, default=4, help="residual MLP blocks")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--meshes", default="1d,2d", help="comma list of 1d (FSDP) and 2d (FSDP x TP)")
    p.add_argument("--optimizers", default="sgd,adam_fused", help="comma list of sgd, adam_fused")
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--no-streaming", action="store_true", help="skip the streaming-statistics arm")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="cuda (NCCL) when available, else cpu (gloo)")  # fmt: skip
    p.add_argument("--threads-per-rank", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("shardscale-bench"),
                   help="folder for bench.json and bench.png (default ./shardscale-bench)")  # fmt: skip
    p.set_defaults(func=run_bench)
    return p


def plot_bench_json(result: dict[str, Any], path: Path) -> Path:
    """Bar chart of the benchmark JSON: post-processing and whole-step time, as ratios to torch."""
    from shardscale.cli._plots import plot_benchmark

    labels = [f"{row['mesh']} {row['optimizer']}" for row in result["rows"]]
    recipes: list[str] = []
    for row in result["rows"]:
        for name in row["recipes"]:
            if name not in recipes:
                recipes.append(name)
    panels = {
        "post-processing time / torch": {
            r: [float(row["recipes"].get(r, {}).get("post_ratio", float("nan")))
                for row in result["rows"]] for r in recipes
        },
        "whole step time / torch": {
            r: [float(row["recipes"].get(r, {}).get("step_ratio", float("nan")))
                for row in result["rows"]] for r in recipes
        },
        "collectives per step": {
            r: [float(row["recipes"].get(r, {}).get("collectives", float("nan")))
                for row in result["rows"]] for r in recipes
        },
    }  # fmt: skip
    cfg, env = result["config"], result["environment"]
    title = (
        f"unscale_and_clip_ vs torch: {cfg['n_params'] / 1e6:.3g}M params, FSDP2, "
        f"{cfg['world_size']} ranks, {env['device']} (lower is better)"
    )
    return plot_benchmark(labels, panels, path, title=title)


def run_bench(args: argparse.Namespace, *, stream: TextIO | None = None) -> int:
    """Run the benchmark; print the table, write JSON and PNG. Exit status 2 on bad options."""
    out = stream if stream is not None else sys.stdout
    try:
        from shardscale.clip._bench import format_table, run_benchmark
    except ImportError as exc:
        print(f"error: the benchmark comes with shardscale-clip: pip install shardscale-clip "
              f"({exc})", file=sys.stderr)  # fmt: skip
        return 2
    import torch

    from shardscale.cli._ui import UI_EXTRA_HINT, have_matplotlib

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out_dir: Path = args.out.resolve()
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / BENCH_JSON
    print(f"shardscale bench: {args.world_size} processes on {device}; this takes a few minutes",
          file=out, flush=True)  # fmt: skip
    try:
        result = run_benchmark(
            world_size=args.world_size, steps=args.steps, warmup=args.warmup, repeats=args.repeats, width=args.width,
            hidden=args.hidden, blocks=args.blocks, batch=args.batch,
            meshes=[m for m in args.meshes.split(",") if m],
            optimizers=[o for o in args.optimizers.split(",") if o],
            max_norm=args.max_norm, streaming=not args.no_streaming, device=device,
            threads_per_rank=args.threads_per_rank, json_path=json_path,
        )  # fmt: skip
    except ValueError as exc:
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()  # bad arguments leave nothing behind
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(result), file=out)
    print(f"\njson: {json_path}", file=out)
    if not have_matplotlib():
        print(f"no chart: matplotlib is not installed ({UI_EXTRA_HINT})", file=out)
        return 0
    png = plot_bench_json(json.loads(json_path.read_text(encoding="utf-8")), out_dir / BENCH_PNG)
    print(f"chart: {png}", file=out, flush=True)
    return 0
