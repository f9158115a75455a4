"""``shardscale bench``: parse and check the options, run :mod:`shardscale.cli.bench`, keep results.

Every option is checked before any folder or process is created; a bad one
prints one line on stderr and exits with status 2. A run writes
``bench.json``, ``bench.md`` (the README's tables) and, with matplotlib,
``bench.png`` into ``--out``, replacing what an earlier run left there (old
and new results never mix). ``--from-json FILE [FILE ...]`` prints the tables
of an earlier run (and, with several files, the ranges over them) without
running anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, NoReturn, TextIO

__all__ = [
    "BENCH_JSON",
    "BENCH_MD",
    "BENCH_PNG",
    "POLICIES_JSON",
    "POLICIES_MD",
    "add_bench_parser",
    "plot_bench_json",
    "run_bench",
]

BENCH_JSON = "bench.json"
BENCH_MD = "bench.md"
BENCH_PNG = "bench.png"
POLICIES_JSON = "bench-policies.json"
POLICIES_MD = "bench-policies.md"

# argparse dest -> BenchConfig field, for the options that map one to one.
_FIELDS = {
    "world_size": "world_size", "steps": "steps", "warmup": "warmup", "width": "width",
    "hidden": "hidden", "blocks": "blocks", "batch": "batch", "max_norm": "max_norm",
    "backend": "backend", "threads_per_rank": "threads_per_rank", "seed": "seed",
    "resamples": "resamples", "repeats": "repeats", "cold_repeats": "cold_repeats",
    "scaling_budget": "scaling_budget_s", "scaling_param_numel": "scaling_param_numel",
}  # fmt: skip


def _one_line_error(prog: str) -> Any:
    def error(message: str) -> NoReturn:
        print(f"{prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    return error


def add_bench_parser(sub: Any) -> argparse.ArgumentParser:
    """Register the ``bench`` subcommand."""
    p: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="measure unscale_and_clip_ against torch's unscale_ + clip_grad_norm_",
        description="Time torch's recipe, torch's recipe again (A/A), unscale_and_clip_ and "
        "unscale_and_clip_ with streaming statistics on one FSDP2 model, interleaved in a "
        "balanced order; ratios with 95 %% bootstrap intervals, collectives and gradient bytes "
        "counted, plus a scaling table against the number of parameters.",
    )
    # Bad values are one line on stderr and exit status 2, parse errors included.
    p.error = _one_line_error("shardscale bench")  # type: ignore[method-assign]
    a = p.add_argument
    a("--quick", action="store_true", help="smoke run: tiny model, 4 rounds, 2 scaling points")
    a("--world-size", type=int, help="processes (default 2)")
    a("--steps", type=int, help="measured rounds per arm (default 32, rounded up to whole "
      "balanced cycles)")  # fmt: skip
    a("--warmup", type=int, help="untimed rounds first (default 4)")
    a("--width", type=int, help="model width (default 512)")
    a("--hidden", type=int, help="MLP hidden size (default 2048)")
    a("--blocks", type=int, help="residual MLP blocks (default 4)")
    a("--batch", type=int, help="batch size per rank (default 8)")
    a("--meshes", "--mesh", help="comma list of 1d (FSDP), 2d (FSDP x TP=2), N or AxB (dp x tp); "
      "default 1d,2d")  # fmt: skip
    a("--optimizers", help="comma list of sgd, adam_fused (default both)")
    a("--max-norm", type=float, help="clipping threshold (default 1.0)")
    a("--no-streaming", action="store_true", help="leave out the streaming-statistics arm")
    a("--scaling-only", action="store_true", help="only the scaling table")
    a("--policies", action="store_true", help="instead: what each skip policy of the scaler "
      "costs per step (none, loss_scaling=False, spike, loss check, streak, all; A/A line)")  # fmt: skip
    a("--backend", help="shardscale's collective backend (default counting+c10d)")
    a("--device", help="cpu (gloo) or cuda (NCCL); default cuda when available")
    a("--threads-per-rank", type=int, help="torch threads per rank (default: CPUs / ranks)")
    a("--seed", type=int, help="bootstrap seed (default 0)")
    a("--resamples", type=int, help="bootstrap resamples (default 2000)")
    a("--scaling-points", help="comma list of parameter counts for the scaling table, or none "
      "(default 250,500,1000,2000,4000)")  # fmt: skip
    a("--scaling-budget", type=float, help="seconds for the scaling table (default 300)")
    a("--scaling-param-numel", type=int, help="elements per scaling parameter (default 8)")
    a("--repeats", type=int, help="warm repeats per scaling point and arm (default 10)")
    a("--cold-repeats", type=int, help="cold samples per scaling point and arm (default 3)")
    a("--out", type=Path, default=Path("shardscale-bench"),
      help="folder for bench.json, bench.md and bench.png (default ./shardscale-bench)")  # fmt: skip
    a("--json", type=Path, help="also write the JSON here")
    a("--from-json", type=Path, nargs="+", metavar="FILE",
      help="print the tables of earlier runs instead of running (ranges over several)")  # fmt: skip
    a("--markdown", action="store_true", help="print Markdown (the README's tables)")
    p.set_defaults(func=run_bench)
    return p


def _csv(text: str, option: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(","))
    if not text.strip() or any(not s for s in items):
        from shardscale.cli.bench import BenchOptionError

        raise BenchOptionError(f"{option} needs a comma list without empty items, got {text!r}")
    return items


def config_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~shardscale.cli.bench.BenchConfig` the options ask for, checked."""
    from shardscale.cli.bench import BenchConfig, BenchOptionError, check_config, quick

    cfg = quick(BenchConfig()) if args.quick else BenchConfig()
    changes: dict[str, Any] = {
        field: getattr(args, dest)
        for dest, field in _FIELDS.items()
        if getattr(args, dest) is not None
    }
    if args.meshes is not None:
        changes["meshes"] = _csv(args.meshes, "--meshes")
    if args.optimizers is not None:
        changes["optimizers"] = _csv(args.optimizers, "--optimizers")
    if args.no_streaming:
        changes["streaming"] = False
    if args.scaling_only:
        changes["rows"] = False
    if args.scaling_points is not None:
        text = args.scaling_points.strip().lower()
        if text == "none":
            changes["scaling_points"] = ()
        else:
            try:
                changes["scaling_points"] = tuple(
                    int(x) for x in _csv(args.scaling_points, "--scaling-points")
                )
            except ValueError:
                raise BenchOptionError(
                    f"--scaling-points needs whole numbers or none, got {args.scaling_points!r}"
                ) from None
    if args.device is not None:
        changes["device"] = args.device
    else:
        import torch

        changes["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = dataclasses.replace(cfg, **changes)
    check_config(cfg)
    if cfg.device == "cuda":
        import torch

        if torch.cuda.device_count() < cfg.world_size:
            raise BenchOptionError(
                f"--device cuda needs {cfg.world_size} GPUs, found {torch.cuda.device_count()}"
            )
    return cfg


def _unwritable(path: Path, *, folder: bool) -> str | None:
    """Why ``path`` (a folder to create or fill, or a file to write) cannot be written, or None."""
    if path.exists():
        if folder and not path.is_dir():
            return "exists and is not a folder"
        if not folder and path.is_dir():
            return "is a folder"
        target = path if folder else path.parent
        return None if os.access(target, os.W_OK | os.X_OK) else f"{target} is not writable"
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a folder"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"{parent} is not writable"


def _check_outputs(args: argparse.Namespace) -> None:
    from shardscale.cli.bench import BenchOptionError

    checks = [("--out", args.out, True)]
    if args.json is not None:
        checks.append(("--json", args.json, False))
    for option, path, folder in checks:
        why = _unwritable(path.resolve(), folder=folder)
        if why is not None:
            raise BenchOptionError(f"{option} {path}: {why}")


def _load_runs(paths: list[Path]) -> list[dict[str, Any]]:
    from shardscale.cli.bench import BenchOptionError, analyse

    runs = []
    for path in paths:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise BenchOptionError(f"--from-json {path}: {type(exc).__name__}: {exc}") from None
        if not isinstance(data, dict) or data.get("schema") != 1:
            raise BenchOptionError(f"--from-json {path}: not a shardscale bench JSON (schema 1)")
        # A --policies run is printed as it was written (its analysis is inside it).
        runs.append(data if data.get("kind") == "policies" else analyse(data))
    kinds = {run.get("kind", "engine") for run in runs}
    if len(kinds) > 1:
        raise BenchOptionError(
            "--from-json mixes --policies runs with the engine benchmark's; give one kind at a time"
        )
    return runs


def plot_bench_json(result: dict[str, Any], path: Path) -> Path:
    """Bar chart of a run: whole-step and post-processing time as ratios to torch, collectives."""
    from shardscale.cli._plots import plot_benchmark

    rows = result.get("rows", [])
    labels = [f"{row['mesh']} {row['optimizer']}" for row in rows]
    arms: list[str] = []
    for row in rows:
        arms += [a for a in row["arms"] if a not in arms]

    def series(value: Any) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for arm in arms:
            vals = []
            for row in rows:
                rec = row["arms"].get(arm)
                v = value(arm, rec) if rec is not None else None
                vals.append(float(v) if v is not None else math.nan)
            out[arm] = vals
        return out

    def ratio(metric: str) -> Any:
        return lambda arm, rec: 1.0 if arm == "torch" else rec["ratio"][metric]["ratio"]

    panels = {
        "whole step time / torch": series(ratio("step")),
        "post-processing time / torch": series(ratio("post")),
        "collectives per step": series(lambda arm, rec: rec["collectives"]),
    }
    cfg, env = result["config"], result["environment"]
    title = (
        f"shardscale bench: {cfg['n_params'] / 1e6:.3g}M params, FSDP2, {cfg['world_size']} ranks, "
        f"{env['device']}, medians (lower is better; intervals in bench.md)"
    )
    return plot_benchmark(labels, panels, path, title=title)


def _print_runs(runs: list[dict[str, Any]], markdown: bool, out: TextIO) -> None:
    from shardscale.cli.bench import format_markdown, format_ranges, format_table

    if runs[0].get("kind") == "policies":
        from shardscale.cli.bench._policies import format_policies

        print("\n\n".join(format_policies(run, markdown=markdown) for run in runs), file=out)
        return

    print(format_markdown(runs[0]) if markdown else format_table(runs[0]), file=out)
    if len(runs) > 1:
        print("\n" + format_ranges(runs), file=out)


def _run_policies(cfg: Any, args: argparse.Namespace, out: TextIO) -> int:
    """``--policies``: the policy-cost table (``bench/_policies.py``), its JSON and Markdown."""
    from shardscale.cli.bench._policies import format_policies, run_policies
    from shardscale.cli.bench._report import write_json

    result = run_policies(cfg)
    out_dir: Path = args.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = write_json(result, out_dir / POLICIES_JSON)
    (out_dir / POLICIES_MD).write_text(format_policies(result, markdown=True) + "\n", "utf-8")
    extra = write_json(result, args.json.resolve()) if args.json is not None else None
    print(format_policies(result, markdown=args.markdown), file=out)
    print(f"\njson: {json_path}" + (f" and {extra}" if extra else ""), file=out)
    print(f"markdown: {out_dir / POLICIES_MD}", file=out, flush=True)
    return 0


def run_bench(args: argparse.Namespace, *, stream: TextIO | None = None) -> int:
    """Run the benchmark (or print earlier runs); exit status 2 on a bad option, else 0."""
    from shardscale.cli.bench import BenchOptionError

    out = stream if stream is not None else sys.stdout
    try:
        if args.from_json:
            _print_runs(_load_runs(list(args.from_json)), args.markdown, out)
            return 0
        if args.policies and (args.scaling_only or args.scaling_points is not None):
            raise BenchOptionError(
                "--policies times the skip policies only; --scaling-only and --scaling-points "
                "belong to the engine benchmark (leave them out, or run without --policies)"
            )
        cfg = config_from_args(args)
        _check_outputs(args)
    except BenchOptionError as exc:
        print(f"shardscale bench: error: {exc}", file=sys.stderr)
        return 2
    from shardscale.cli._ui import UI_EXTRA_HINT, have_matplotlib
    from shardscale.cli.bench import analyse, format_markdown, run_benchmark, write_json

    print(f"shardscale bench: {cfg.world_size} processes on {cfg.device}"
          f"{' (quick)' if args.quick else ''}; this takes a few minutes", file=out, flush=True)  # fmt: skip
    if args.policies:
        return _run_policies(cfg, args, out)
    result = analyse(run_benchmark(cfg))
    out_dir: Path = args.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / BENCH_PNG
    png.unlink(missing_ok=True)  # a chart of an earlier run must not stay beside this run's JSON
    json_path = write_json(result, out_dir / BENCH_JSON)
    (out_dir / BENCH_MD).write_text(format_markdown(result) + "\n", encoding="utf-8")
    extra = write_json(result, args.json.resolve()) if args.json is not None else None
    _print_runs([result], args.markdown, out)
    print(f"\njson: {json_path}" + (f" and {extra}" if extra else ""), file=out)
    print(f"markdown: {out_dir / BENCH_MD}", file=out)
    if not result.get("rows"):
        print("no chart: the chart shows the timed rows, and this run has none", file=out)
        return 0
    if not have_matplotlib():
        print(f"no chart: matplotlib is not installed ({UI_EXTRA_HINT})", file=out)
        return 0
    plot_bench_json(json.loads(json_path.read_text(encoding="utf-8")), png)
    print(f"chart: {png}", file=out, flush=True)
    return 0
