"""``shardscale bench [host|scale]``: parse and check the options, run the benchmark, keep results.

Every option is checked before any folder or process is created; a bad one
prints ``shardscale bench: error: ...`` on stderr (after the command's usage
when the command line itself does not parse) and exits with status 2. A run
writes ``bench.json``, ``bench.md`` (the README's tables) and, with
matplotlib, ``bench.png`` into ``--out DIR``, replacing what an earlier run
left there (old and new results never mix). The tables go to stdout, the
progress to stderr; ``--json`` prints the result as JSON on stdout instead of
the tables (everything else on stderr). ``--from-json FILE [FILE ...]`` prints
the tables of an earlier run (and, with several files, the ranges over them)
without running anything.

``shardscale bench host`` is the host table (``bench/_host.py``);
``shardscale bench scale`` runs the scale table's script from a clone
(``benchmarks/bench_scale.py``: the simulator is not part of any wheel).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "BENCH_JSON",
    "BENCH_MD",
    "BENCH_PNG",
    "POLICIES_JSON",
    "POLICIES_MD",
    "add_bench_parser",
    "bench_figure",
    "find_scale_script",
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
    "backend": "backend", "threads_per_rank": "threads_per_rank", "seed": "seed", "amp": "amp",
    "resamples": "resamples", "repeats": "repeats", "cold_repeats": "cold_repeats",
    "scaling_budget": "scaling_budget_s", "scaling_param_numel": "scaling_param_numel",
}  # fmt: skip


PROG = "shardscale bench"
#: The scale table's script in a clone, relative to the clone's root.
SCALE_SCRIPT = Path("benchmarks") / "bench_scale.py"


def add_bench_parser(sub: Any) -> argparse.ArgumentParser:
    """Register the ``bench`` command and its ``host`` and ``scale`` subcommands."""
    from shardscale.cli._cmdline import CommandParser, add_command
    from shardscale.cli._mesh_spec import MESH_GRAMMAR

    p = add_command(
        sub,
        "bench",
        help="measure unscale_and_clip_ against torch's unscale_ + clip_grad_norm_",
        description="Time torch's recipe, torch's recipe again (A/A), unscale_and_clip_ and "
        "unscale_and_clip_ with streaming statistics on one FSDP2 model, interleaved in a "
        "balanced order; ratios with 95 % bootstrap intervals, collectives and gradient bytes "
        "counted, plus a scaling table against the number of parameters. 'bench host': the "
        "host's work against the number of parameters; 'bench scale': the scale table (from a "
        "clone).",
    )
    a = p.add_argument
    a("--quick", action="store_true",
      help="smoke run: tiny model, 4 rounds, 2 scaling points (too few rounds for verdicts)")  # fmt: skip
    a("--world-size", type=int, help="processes (default 2)")
    a("--steps", type=int, help="measured rounds per arm (default 32, rounded up to whole "
      "balanced cycles)")  # fmt: skip
    a("--warmup", type=int, help="untimed rounds first (default 4)")
    a("--width", type=int, help="model width (default 512)")
    a("--hidden", type=int, help="MLP hidden size (default 2048)")
    a("--blocks", type=int, help="residual MLP blocks (default 4)")
    a("--batch", type=int, help="batch size per rank (default 8)")
    a("--meshes", "--mesh", metavar="MESHES", help=f"{MESH_GRAMMAR}; dp (FSDP) and tp only; "
      "default dpW,dpW/2xtp2 for world size W (dp2,dp1xtp2)")  # fmt: skip
    a("--optimizers", help="comma list of sgd, adam_fused (default both)")
    a("--max-norm", type=float, help="clipping threshold (default 1.0)")
    a("--no-streaming", action="store_true", help="leave out the streaming-statistics arm")
    a("--scaling-only", action="store_true", help="only the scaling table")
    a("--policies", action="store_true", help="instead: what each skip policy of the scaler "
      "costs per step (none, loss_scaling=False, spike, loss check, streak, all; A/A line)")  # fmt: skip
    a("--backend", help="shardscale's collective backend (default counting+c10d)")
    a("--device", help="cpu (gloo) or cuda (NCCL); default cuda when available")
    a("--amp", choices=("none", "fp16", "bf16"),
      help="forward under torch.autocast in fp16 or bf16 (default none: fp32)")  # fmt: skip
    a("--threads-per-rank", type=int, help="torch threads per rank (default: CPUs / ranks)")
    a("--seed", type=int, help="bootstrap seed (default 0)")
    a("--resamples", type=int, help="bootstrap resamples (default 2000)")
    a("--scaling-points", help="comma list of parameter counts for the scaling table, or none "
      "(default 250,500,1000,2000,4000)")  # fmt: skip
    a("--scaling-budget", type=float, help="seconds for the scaling table (default 300)")
    a("--scaling-param-numel", type=int, help="elements per scaling parameter (default 8)")
    a("--repeats", type=int, help="warm repeats per scaling point and arm (default 10)")
    a("--cold-repeats", type=int, help="cold samples per scaling point and arm (default 3)")
    a("--out", type=Path, default=Path("shardscale-bench"), metavar="DIR",
      help="folder for bench.json, bench.md and bench.png (default ./shardscale-bench)")  # fmt: skip
    a("--json", action="store_true",
      help="print the result as JSON on stdout instead of the tables")  # fmt: skip
    a("--from-json", type=Path, nargs="+", metavar="FILE",
      help="print the tables of earlier runs instead of running (ranges over several)")  # fmt: skip
    a("--markdown", action="store_true", help="print Markdown (the README's tables)")
    p.set_defaults(func=run_bench)
    subs = p.add_subparsers(dest="bench_command", metavar="[host|scale]",
                            parser_class=CommandParser)  # fmt: skip
    _add_host(subs)
    _add_scale(subs)
    return p


def _add_host(subs: Any) -> None:
    from shardscale.cli._cmdline import add_command
    from shardscale.cli.bench._host import add_host_arguments

    h = add_command(
        subs,
        "host",
        help="the host's work before the optimizer against the number of parameters",
        description="The host table: torch's unscale_ + clip_grad_norm_, torch again (A/A) and "
        "unscale_and_clip_ on 500 to 20 000 tiny FSDP2 parameters, 2 gloo ranks x 1 thread, "
        "warm and cold, interleaved; ratios with 95 % bootstrap intervals. About ten minutes "
        "on 2 cores (--quick: a smoke run).",
    )
    add_host_arguments(h)
    h.set_defaults(func=_run_host)


def _add_scale(subs: Any) -> None:
    from shardscale.cli._cmdline import add_command

    s = add_command(
        subs,
        "scale",
        help="the scale table: the step engine simulated at 1 024 to 131 072 ranks (a clone)",
        description="Runs benchmarks/bench_scale.py of a shardscale clone (the simulator is not "
        "in any wheel): the step engine on torch's fake process group at 1 024 to 131 072 ranks "
        "and the all-reduce modelled with NCCL's tuning model. Found from the current folder "
        "upwards or --repo. About five minutes on 2 cores (--quick: 16 and 32 ranks).",
    )
    s.add_argument("--repo", type=Path, default=None, metavar="DIR",
                   help="the clone to run it from (default: the one holding the current folder)")  # fmt: skip
    s.add_argument("--worlds", type=int, nargs="+", default=None, metavar="N",
                   help="world sizes (multiples of 8, at least 16; default 1024 ... 131072)")  # fmt: skip
    s.add_argument("--repeats", type=int, default=None, help="timed steps per simulated rank")
    s.add_argument("--quick", action="store_true", help="smoke run: 16 and 32 ranks, 2 steps")
    s.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="folder for bench-scale.json and bench-scale.md (default ./shardscale-bench)")  # fmt: skip
    s.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    s.set_defaults(func=_run_scale)


def _run_host(args: argparse.Namespace) -> int:
    from shardscale.cli.bench._host import run_host_command

    return run_host_command(args, prog=f"{PROG} host")


def find_scale_script(repo: Path | None, *, start: Path | None = None) -> Path | None:
    """``benchmarks/bench_scale.py`` of the clone at ``repo``, else of the first folder from
    ``start`` (the current one) upwards that has it; None when there is none."""
    if repo is not None:
        path = repo / SCALE_SCRIPT
        return path if path.is_file() else None
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / SCALE_SCRIPT).is_file():
            return folder / SCALE_SCRIPT
    return None


def _run_scale(args: argparse.Namespace) -> int:
    script = find_scale_script(args.repo)
    if script is None:
        where = f"--repo {args.repo} has no {SCALE_SCRIPT}" if args.repo is not None else (
            f"no {SCALE_SCRIPT} in this folder or above it")  # fmt: skip
        print(f"{PROG} scale: error: {where}; the scale table runs from a clone of shardscale "
              "(not in any wheel): in the clone run 'nox -s bench_scale', or pass --repo "
              "CLONE", file=sys.stderr)  # fmt: skip
        return 2
    argv = [sys.executable, str(script)]
    if args.worlds is not None:
        argv += ["--worlds", *map(str, args.worlds)]
    if args.repeats is not None:
        argv += ["--repeats", str(args.repeats)]
    argv += ["--quick"] * args.quick + ["--json"] * args.json
    argv += ["--out", str(args.out if args.out is not None else Path("shardscale-bench"))]
    return subprocess.run(argv, check=False).returncode


def _csv(text: str, option: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(","))
    if not text.strip() or any(not s for s in items):
        from shardscale.cli.bench import BenchOptionError

        raise BenchOptionError(f"{option} needs a comma list without empty items, got {text!r}")
    return items


def _meshes(text: str, world: int) -> tuple[str, ...]:
    """The meshes of ``--meshes`` (the grammar of ``_mesh_spec``), checked, spelled canonically."""
    from shardscale.cli._mesh_spec import MeshSpecError, parse_mesh_list
    from shardscale.cli.bench import BenchOptionError
    from shardscale.cli.bench._config import mesh_shape

    pieces = [piece.strip() for piece in text.split(",")]
    old = [p for p in pieces if p.lower() in ("1d", "2d")]
    if old:
        raise BenchOptionError(f"--meshes {text!r}: {old[0]} is the old spelling; write "
                               f"dp{world} (1d) or dp{world // 2}xtp2 (2d)")  # fmt: skip
    try:
        specs = parse_mesh_list(text, option="--meshes")
    except MeshSpecError as exc:
        raise BenchOptionError(str(exc)) from None
    for piece in pieces:
        mesh_shape(piece, world)  # names the mesh as the user wrote it
    return tuple(str(spec) for spec in specs)


def config_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~shardscale.cli.bench.BenchConfig` the options ask for, checked."""
    from shardscale.cli.bench import BenchConfig, BenchOptionError, check_config, quick

    cfg = quick(BenchConfig()) if args.quick else BenchConfig()
    changes: dict[str, Any] = {
        field: getattr(args, dest)
        for dest, field in _FIELDS.items()
        if getattr(args, dest) is not None
    }
    world = args.world_size if args.world_size is not None else cfg.world_size
    if args.meshes is not None:
        changes["meshes"] = _meshes(args.meshes, world)
    else:
        changes["meshes"] = (f"dp{world}",) + ((f"dp{world // 2}xtp2",) if world % 2 == 0 else ())
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
    """Bar chart of a run: whole-step and post-processing time as ratios to torch (with their
    intervals), collectives; the title says the model's size and whether it is a smoke run."""
    from shardscale.cli._plots import plot_benchmark

    labels, panels, title, intervals = _chart(result)
    return plot_benchmark(labels, panels, path, title=title, intervals=intervals)


def bench_figure(result: dict[str, Any]) -> Any:
    """The matplotlib figure :func:`plot_bench_json` draws (for looking at it, or testing it)."""
    from shardscale.cli._plots import benchmark_figure

    labels, panels, title, intervals = _chart(result)
    return benchmark_figure(labels, panels, title=title, intervals=intervals)


def _chart(result: dict[str, Any]) -> tuple[list[str], Any, str, Any]:
    from shardscale.cli.bench._report import _LABEL

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
            out[_LABEL.get(arm, arm)] = vals
        return out

    def ratio(metric: str) -> Any:
        return lambda arm, rec: 1.0 if arm == "torch" else rec["ratio"][metric]["ratio"]

    def bound(metric: str, end: str) -> Any:
        return lambda arm, rec: math.nan if arm == "torch" else rec["ratio"][metric][end]

    panels = {
        "whole step time / torch": series(ratio("step")),
        "post-processing time / torch": series(ratio("post")),
        "collectives per step": series(lambda arm, rec: rec["collectives"]),
    }
    # torch is the reference (exactly 1): no interval. Counts have none either.
    intervals = {
        name: (series(bound(metric, "low")), series(bound(metric, "high")))
        for name, metric in (("whole step time / torch", "step"),
                             ("post-processing time / torch", "post"))
    }  # fmt: skip
    from shardscale.cli.bench._report import is_smoke, params_text

    cfg, env = result["config"], result["environment"]
    rounds = rows[0]["rounds"] if rows else 0
    kind = (f"smoke run ({rounds} rounds: too few for verdicts)" if is_smoke(result)
            else f"full run ({rounds} rounds)")  # fmt: skip
    title = (
        f"shardscale bench: {params_text(cfg['n_params'])} params, FSDP2, {cfg['world_size']} "
        f"ranks, {env['device']}\n{kind}\nmedians with 95 % intervals (lower is better)"
    )
    return labels, panels, title, intervals


def _print_runs(runs: list[dict[str, Any]], markdown: bool, out: TextIO) -> None:
    from shardscale.cli.bench import format_markdown, format_ranges, format_table

    if runs[0].get("kind") == "policies":
        from shardscale.cli.bench._policies import format_policies

        print("\n\n".join(format_policies(run, markdown=markdown) for run in runs), file=out)
        return

    print(format_markdown(runs[0]) if markdown else format_table(runs[0]), file=out)
    if len(runs) > 1:
        print("\n" + format_ranges(runs), file=out)


def _emit(result: dict[str, Any], args: argparse.Namespace, out: TextIO, human: TextIO) -> None:
    """The result on stdout: JSON with ``--json``, else the tables."""
    from shardscale.cli.bench._report import sanitize

    if args.json:
        print(json.dumps(sanitize(result), indent=1), file=out, flush=True)
    else:
        _print_runs([result], args.markdown, human)


def _run_policies(cfg: Any, args: argparse.Namespace, out: TextIO, human: TextIO) -> int:
    """``--policies``: the policy-cost table (``bench/_policies.py``), its JSON and Markdown."""
    from shardscale.cli.bench._policies import format_policies, run_policies
    from shardscale.cli.bench._report import write_json

    result = run_policies(cfg, progress=sys.stderr)
    out_dir: Path = args.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = write_json(result, out_dir / POLICIES_JSON)
    (out_dir / POLICIES_MD).write_text(format_policies(result, markdown=True) + "\n", "utf-8")
    _emit(result, args, out, human)
    print(f"\njson: {json_path}", file=human)
    print(f"markdown: {out_dir / POLICIES_MD}", file=human, flush=True)
    return 0


def run_bench(args: argparse.Namespace, *, stream: TextIO | None = None) -> int:
    """Run the benchmark (or print earlier runs); exit status 2 on a bad option, else 0.

    The tables (or with ``--json`` the JSON) go to ``stream`` (default stdout); the progress
    and, with ``--json``, every other line go to stderr.
    """
    from shardscale.cli.bench import BenchOptionError

    out = stream if stream is not None else sys.stdout
    human = sys.stderr if args.json else out
    try:
        if args.from_json:
            runs = _load_runs(list(args.from_json))
            if args.json:
                from shardscale.cli.bench._report import sanitize

                print(json.dumps(sanitize(runs[0] if len(runs) == 1 else runs), indent=1),
                      file=out)  # fmt: skip
            else:
                _print_runs(runs, args.markdown, out)
            return 0
        if args.policies and (args.scaling_only or args.scaling_points is not None):
            raise BenchOptionError(
                "--policies times the skip policies only; --scaling-only and --scaling-points "
                "belong to the engine benchmark (leave them out, or run without --policies)"
            )
        cfg = config_from_args(args)
        _check_outputs(args)
    except BenchOptionError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    from shardscale.cli._ui import UI_EXTRA_HINT, have_matplotlib
    from shardscale.cli.bench import analyse, format_markdown, run_benchmark, write_json
    from shardscale.cli.bench._report import is_smoke

    print(f"{PROG}: {cfg.world_size} processes on {cfg.device}"
          f"{' (smoke run)' if args.quick else ''}; this takes a few minutes", file=sys.stderr,
          flush=True)  # fmt: skip
    if args.policies:
        return _run_policies(cfg, args, out, human)
    result = analyse(run_benchmark(cfg, progress=sys.stderr))
    out_dir: Path = args.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / BENCH_PNG
    png.unlink(missing_ok=True)  # a chart of an earlier run must not stay beside this run's JSON
    json_path = write_json(result, out_dir / BENCH_JSON)
    (out_dir / BENCH_MD).write_text(format_markdown(result) + "\n", encoding="utf-8")
    if is_smoke(result):
        from shardscale.cli.bench._stats import SMOKE_RUN

        print(SMOKE_RUN, file=sys.stderr, flush=True)
    _emit(result, args, out, human)
    print(f"\njson: {json_path}", file=human)
    print(f"markdown: {out_dir / BENCH_MD}", file=human)
    if not result.get("rows"):
        print("no chart: the chart shows the timed rows, and this run has none", file=human)
        return 0
    if not have_matplotlib():
        print(f"no chart: matplotlib is not installed ({UI_EXTRA_HINT})", file=human)
        return 0
    plot_bench_json(json.loads(json_path.read_text(encoding="utf-8")), png)
    print(f"chart: {png}", file=human, flush=True)
    return 0
