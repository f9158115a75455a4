"""The host benchmark: the host's work before the optimizer against the number of parameters.

[Note: the host table]
With tiny gradients the arithmetic of a step vanishes and what is left is the
host's work: Python, dispatch, DTensor unwrapping, one launch per tensor group
-- the part that bounds a GPU step of a model with 10^4 parameters (MoE
experts). Here it is measured on the CPU, on ``N`` tiny FSDP2 parameters over
a 1-D mesh of every rank (2 gloo ranks by default, 1 thread each):

* the work timed is everything before the optimizer: torch's
  ``scaler.unscale_(opt)`` + ``torch.nn.utils.clip_grad_norm_`` and reading
  the norm (``full_tensor()`` of the DTensor it returns), against
  ``unscale_and_clip_`` and reading its norm; ``update()`` and restoring the
  gradients are untimed. A sample is the slowest rank's wall time;
* arms: ``torch``, ``torch_aa`` (torch again, on a second copy: the A/A noise
  floor) and ``ours``, interleaved in a balanced order (``_order``) round by
  round; ratios of medians with paired bootstrap intervals (``_stats``);
* **warm**: the same call again on one layout (the common step);
* **cold**: the first call on a layout never seen before. Ours: the
  parameter list rotated by 1, 2, 3 ... in an optimizer of its own
  (``cold_repeats`` of them, at least 5, so no sample finds another's step
  plan), one after each of the first warm rounds; cold / warm is the ratio of
  the medians with an unpaired bootstrap interval.
  torch: the torch arm's first call, one
  sample, reported apart: DTensor's sharding propagation of a foreach op over
  N DTensors grows about quadratically on its first call (pytorch#169445),
  torch runs up to ``torch_max`` (4 000) parameters and beyond only while
  its projected cold calls fit ``torch_budget_s``; other points run ours
  alone. Ours cold is stepped by a scaler that has stepped before (a layout
  that changes mid-training), so the scaler's own first-step checks are not
  charged to the layout;
* **growth**: ours warm at the largest point against ``growth_base`` (4 000)
  parameters, both layouts alive at once and alternating round by round
  after the points (a paired interval): the points run minutes apart, so
  their own ratio also carries the machine's drift;
* ``clock``: ``wall`` (the default) or ``cpu``, each rank's process CPU time,
  which a machine shared with other work disturbs less (the ratios are what
  to compare across machines).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from shardscale.cli.bench._arms import make_scaler
from shardscale.cli.bench._bytes import local_tensor
from shardscale.cli.bench._order import balanced_order, rounds_for
from shardscale.cli.bench._stats import (
    MIN_VERDICT_SAMPLES,
    SMOKE_RUN,
    median,
    ratio_interval,
    summary,
)
from shardscale.cli.bench._workload import TinyParams

if TYPE_CHECKING:
    from shardscale.cli.bench._launch import RankFiles

__all__ = [
    "HostConfig",
    "add_host_arguments",
    "format_host",
    "format_host_text",
    "host_config",
    "main",
    "run_host",
    "run_host_command",
]

_ARMS = ("torch", "torch_aa", "ours")


@dataclass(frozen=True, slots=True, kw_only=True)
class HostConfig:
    """Every knob of one host-table run (the defaults take about ten minutes on 2 cores)."""

    points: tuple[int, ...] = (500, 1000, 2000, 4000, 8000, 20000)
    param_numel: int = 9  # elements per parameter: 5 and 4 per rank, tiny
    rounds: int = 24  # warm rounds per point (each runs every arm once)
    cold_repeats: int = 7  # ours: first calls on fresh layouts per point, among the warm rounds
    torch_max: int = 4000  # torch runs at every point up to this many parameters, and
    torch_budget_s: float = 240.0  # beyond it while its projected cold calls fit this budget
    clock: str = "wall"  # or "cpu": each rank's process CPU time (steadier on a loaded machine)
    growth_base: int = 4000  # ours warm at the largest point against this one, interleaved
    world_size: int = 2
    max_norm: float = 1.0
    backend: str = "counting+c10d"
    seed: int = 0
    resamples: int = 2000

    def check(self) -> None:
        """Raise ValueError (one line, naming the option) for a value that cannot run."""
        if not self.points or any(p < 1 for p in self.points):
            raise ValueError(f"--points must be integers >= 1, got {self.points}")
        for name, value in (
            ("--param-numel", self.param_numel),
            ("--rounds", self.rounds),
            ("--world-size", self.world_size),
            ("--resamples", self.resamples),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.cold_repeats < 5:
            raise ValueError(f"--cold-repeats must be >= 5 (an interval needs them), got "
                             f"{self.cold_repeats}")  # fmt: skip
        if min(self.points) <= self.cold_repeats:
            raise ValueError("every --points value must exceed --cold-repeats (one rotation each)")
        if not self.torch_budget_s >= 0 or not self.max_norm > 0:
            raise ValueError("--torch-budget must be >= 0 and --max-norm > 0")
        if self.clock not in ("wall", "cpu"):
            raise ValueError(f"--clock must be wall or cpu, got {self.clock!r}")


class _Case:
    """One model, optimizer and scaler, with its gradients saved for restoring."""

    def __init__(self, recipe: str, count: int, numel: int, mesh: Any, backend: str) -> None:
        from torch.distributed.fsdp import fully_shard

        self.recipe = recipe
        self.model = TinyParams(count=count, numel=numel)
        fully_shard(self.model, mesh=mesh)
        self.params = list(self.model.parameters())
        self.opt = torch.optim.SGD(self.params, lr=0.0)
        self.scaler: Any = make_scaler(recipe, "cpu", backend)
        self.scaler.scale(self.model()).backward()
        self.saved = [local_tensor(p.grad).clone() for p in self.params if p.grad is not None]

    def restore(self) -> None:
        grads = [local_tensor(p.grad) for p in self.params if p.grad is not None]
        torch._foreach_copy_(grads, self.saved)

    def timed(self, max_norm: float, clock: str = "wall", opt: Any = None) -> float:
        """Seconds before the optimizer on the slowest rank; ``update()`` untimed."""
        import torch.distributed as dist

        opt = self.opt if opt is None else opt
        now = time.process_time if clock == "cpu" else time.perf_counter
        dist.barrier()
        start = now()
        if self.recipe == "ours":
            from shardscale.clip import unscale_and_clip_

            # The multiply done here, as torch's recipe does: folded into the (untimed) optimizer
            # step it would leave ours less work before the optimizer than torch's.
            norm = unscale_and_clip_(self.scaler, opt, max_norm, fuse_optimizer=False)
        else:
            self.scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            full = getattr(norm, "full_tensor", None)
            norm = full() if full is not None else norm
        float(norm)  # reading the norm (logging it) is part of the work
        took = torch.tensor([now() - start], dtype=torch.float64)
        self.scaler.update()
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # every rank decides on the same numbers
        return float(took.item())


def _point(cfg: HostConfig, count: int, mesh: Any, *, with_torch: bool) -> dict[str, Any]:
    arms = _ARMS if with_torch else ("ours",)
    clock = cfg.clock
    out: dict[str, Any] = {"n_params": count}
    cases = {arm: _Case(arm, count, cfg.param_numel + (arm == "ours"), mesh, cfg.backend)
             for arm in arms}  # fmt: skip
    for arm, case in cases.items():
        took = case.timed(cfg.max_norm, clock)  # the first call on this layout: torch's is cold
        if arm == "torch":
            out["torch_cold_s"] = took
        case.restore()
    # Ours cold: layouts never stepped before -- the parameter list rotated, in an optimizer of
    # its own -- stepped by a scaler that has stepped before, as when parameters are frozen or
    # added mid-training: the layout's cost, not the scaler's first step. One cold sample after
    # each of the first warm rounds, so cold and warm share the machine's state of the moment.
    ours = cases["ours"]
    cold_ours: list[float] = []
    warm: dict[str, list[float]] = {arm: [] for arm in arms}
    orders = balanced_order(len(arms), rounds_for(cfg.rounds, len(arms)))
    spread = max(1, len(orders) // cfg.cold_repeats)
    for round_index, order in enumerate(orders):
        for index in order:
            arm = arms[index]
            warm[arm].append(cases[arm].timed(cfg.max_norm, clock))
            cases[arm].restore()
        if round_index % spread == 0 and len(cold_ours) < cfg.cold_repeats:
            cold_ours.append(_cold_sample(ours, len(cold_ours) + 1, cfg.max_norm, clock))
    while len(cold_ours) < cfg.cold_repeats:
        cold_ours.append(_cold_sample(ours, len(cold_ours) + 1, cfg.max_norm, clock))
    out["ours_cold_s"] = cold_ours
    out["warm_s"] = warm
    out["warm"] = {arm: summary(samples) for arm, samples in warm.items()}
    out["us_per_param"] = {arm: median(s) / count * 1e6 for arm, s in warm.items()}
    out["ours_cold"] = summary(cold_ours)
    out["ours_cold_over_warm_derived"] = median(cold_ours) / median(warm["ours"])
    out["cold_over_warm"] = ratio_interval(
        cold_ours, warm["ours"], paired=False, seed=cfg.seed, resamples=cfg.resamples
    ).as_dict()
    if with_torch:
        for name, arm in (("ratio", "ours"), ("aa", "torch_aa")):
            out[name] = ratio_interval(
                warm[arm], warm["torch"], seed=cfg.seed, resamples=cfg.resamples
            ).as_dict()
    return out


def _cold_sample(case: _Case, shift: int, max_norm: float, clock: str) -> float:
    """Ours on a layout never stepped: the parameters rotated by ``shift``, a new optimizer."""
    rotated = case.params[shift:] + case.params[:shift]
    took = case.timed(max_norm, clock, torch.optim.SGD(rotated, lr=0.0))
    case.restore()
    return took


def _growth(points: list[dict[str, Any]], cfg: HostConfig) -> list[dict[str, Any]]:
    """Ours warm at each point against the 4 000 (else the smallest) point, with intervals."""
    if not points:
        return []
    base = next((p for p in points if p["n_params"] == 4000), points[0])
    out = []
    for p in points:
        if p is base:
            continue
        got = ratio_interval(
            p["warm_s"]["ours"], base["warm_s"]["ours"], paired=False,
            seed=cfg.seed, resamples=cfg.resamples,
        )  # fmt: skip
        out.append({
            "n_params": p["n_params"], "base": base["n_params"],
            "params_ratio": p["n_params"] / base["n_params"], "time_ratio": got.as_dict(),
        })  # fmt: skip
    return out


def _interleaved_growth(cfg: HostConfig, mesh: Any) -> dict[str, Any] | None:
    """Ours warm at the largest point against ``growth_base`` parameters, in the same rounds.

    Points run minutes apart on a shared machine, so their ratio carries the load's drift;
    here both layouts live side by side and alternate round by round (a paired interval).
    """
    top = max(cfg.points)
    if cfg.growth_base not in cfg.points or cfg.growth_base >= top:
        return None
    numel = cfg.param_numel + 1
    cases = [_Case("ours", n, numel, mesh, cfg.backend) for n in (cfg.growth_base, top)]
    for case in cases:
        case.timed(cfg.max_norm, cfg.clock)  # each layout's cold call, untimed
        case.restore()
    samples: list[list[float]] = [[], []]
    for order in balanced_order(2, rounds_for(cfg.rounds, 2)):
        for index in order:
            samples[index].append(cases[index].timed(cfg.max_norm, cfg.clock))
            cases[index].restore()
    got = ratio_interval(samples[1], samples[0], seed=cfg.seed, resamples=cfg.resamples)
    return {"n_params": top, "base": cfg.growth_base, "params_ratio": top / cfg.growth_base,
            "time_ratio": got.as_dict(), "samples_s": samples}  # fmt: skip


def _worker(rank: int, files: RankFiles, cfg: HostConfig) -> None:
    import logging

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from shardscale.cli.bench._launch import exit_worker, rank_output_to_log
    from shardscale.cli.bench._progress import ProgressFile

    rank_output_to_log(files, rank)
    result_path = files.result
    progress = ProgressFile(files.progress, enabled=rank == 0)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{files.store}", rank=rank,
                            world_size=cfg.world_size)  # fmt: skip
    try:
        mesh = init_device_mesh("cpu", (cfg.world_size,), mesh_dim_names=("dp",))
        points: list[dict[str, Any]] = []
        spent = 0.0  # on torch's cold calls, the same on every rank (reduced samples)
        last: tuple[int, float] | None = None
        counts = sorted(cfg.points)
        for k, count in enumerate(counts):
            progress.event("points", label=f"{count} parameters", done=k, total=len(counts) + 1)
            # Beyond torch_max, torch runs only on a projection from a point it ran.
            projected = math.inf if last is None else last[1] * (count / last[0]) ** 2
            with_torch = count <= cfg.torch_max or spent + projected <= cfg.torch_budget_s
            started = time.perf_counter()
            point = _point(cfg, count, mesh, with_torch=with_torch)
            if with_torch:
                spent += point["torch_cold_s"]
                last = (count, point["torch_cold_s"])
            else:
                point["torch_skipped"] = (
                    f"torch's cold call projected at {projected:.0f} s (quadratic from "
                    f"{last[0]}), over the {cfg.torch_budget_s:.0f} s budget"
                    if last is not None
                    else f"above --torch-max {cfg.torch_max} with no smaller point to project from"
                )
            point["elapsed_s"] = time.perf_counter() - started
            points.append(point)
            if rank == 0:
                with open(result_path, "w") as fh:  # after every point: a cut run keeps its data
                    json.dump({"points": points, "growth": _growth(points, cfg)}, fh)
        progress.event("points", label="growth, interleaved", done=len(counts),
                       total=len(counts) + 1)  # fmt: skip
        growth = _interleaved_growth(cfg, mesh)
        if rank == 0 and growth is not None:
            with open(result_path, "w") as fh:
                json.dump({"points": points, "growth": _growth(points, cfg),
                           "growth_interleaved": growth}, fh)  # fmt: skip
    finally:
        dist.destroy_process_group()
    exit_worker()


def run_host(cfg: HostConfig, *, progress: TextIO | None = None) -> dict[str, Any]:
    """Run the host table in ``cfg.world_size`` fresh processes; returns the raw results.

    ``progress``: where to show the points as they run (None: nowhere).
    """
    cfg.check()
    from shardscale.cli.bench._launch import run_ranks

    started = time.time()
    load = os.getloadavg()
    raw = run_ranks(_worker, (cfg,), cfg.world_size, stream=progress)
    return {
        "schema": 1,
        "kind": "host",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "elapsed_s": time.time() - started,
        "config": asdict(cfg),
        "environment": {
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "load_average_start": [round(x, 2) for x in load],
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
        },
        **raw,
    }


def _interval(d: dict[str, Any]) -> str:
    return f"{d['ratio']:.2f} [{d['low']:.2f}, {d['high']:.2f}]"


def format_host(result: dict[str, Any]) -> str:
    """The host table and the growth lines, in Markdown."""
    cfg, env = result["config"], result["environment"]
    lines = [
        f"Host work before the optimizer (unscale + clip + reading the norm), {cfg['param_numel']}"
        f"-element FSDP2 parameters, {cfg['world_size']} gloo ranks x 1 thread, "
        f"{cfg.get('clock', 'wall')} clock, torch "
        f"{env['torch']}, {env['cpu_count']} CPUs (load {env['load_average_start']} at the "
        f"start); warm: medians of {cfg['rounds']}+ interleaved rounds, ratios with 95 % paired "
        f"bootstrap intervals; ours cold: min/median/max of {cfg['cold_repeats']} fresh layouts "
        "taken among the warm rounds, cold / warm: ratio of medians with a 95 % unpaired "
        "bootstrap interval; torch cold: its first call, one sample.",
        "",
        "| params | torch cold s | ours cold ms | torch warm ms | ours warm ms | torch µs/param "
        "| ours µs/param | ours / torch [95 % CI] | A/A [95 % CI] | ours cold / warm [95 % CI] |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | ---: |",
    ]
    for p in result["points"]:
        c = p["ours_cold"]
        cold = f"{c['min'] * 1e3:.1f}/{c['median'] * 1e3:.1f}/{c['max'] * 1e3:.1f}"
        has_torch = "torch" in p["warm"]
        tw = f"{p['warm']['torch']['median'] * 1e3:.1f}" if has_torch else "skipped"
        tu = f"{p['us_per_param']['torch']:.1f}" if has_torch else "-"
        tc = f"{p['torch_cold_s']:.2f}" if has_torch else "skipped"
        ratio = _interval(p["ratio"]) if has_torch else "-"
        aa = _interval(p["aa"]) if has_torch else "-"
        cold_warm = (
            _interval(p["cold_over_warm"])
            if "cold_over_warm" in p  # runs before the interval: the ratio alone
            else f"{p['ours_cold_over_warm_derived']:.2f}"
        )
        lines.append(
            f"| {p['n_params']} | {tc} | {cold} | {tw} | {p['warm']['ours']['median'] * 1e3:.1f} "
            f"| {tu} | {p['us_per_param']['ours']:.1f} | {ratio} | {aa} "
            f"| {cold_warm} |"
        )
    for g in result.get("growth", []):
        lines.append(
            f"\nOurs warm, {g['n_params']} / {g['base']} parameters ({g['params_ratio']:.1f}x): "
            f"{_interval(g['time_ratio'])} (unpaired interval)"
        )
    inter = result.get("growth_interleaved")
    if inter is not None:
        lines.append(
            f"\nOurs warm, {inter['n_params']} / {inter['base']} parameters "
            f"({inter['params_ratio']:.1f}x), both layouts alternating in the same rounds: "
            f"{_interval(inter['time_ratio'])} (paired interval)"
        )
    skipped = [f"{p['n_params']}: {p['torch_skipped']}" for p in result["points"]
               if "torch_skipped" in p]  # fmt: skip
    if skipped:
        lines.append("\ntorch not run at " + "; ".join(skipped))
    return "\n".join(lines)


def format_host_text(result: dict[str, Any]) -> str:
    """The host table as plain text within 120 columns (the Markdown has the µs/param columns)."""
    import textwrap

    md = format_host(result).split("\n")
    head = textwrap.wrap(md[0], width=118)
    rows = [("params", "torch cold s", "ours cold ms", "torch ms", "ours ms",
             "ours/torch [95% CI]", "A/A [95% CI]", "cold/warm [95% CI]")]  # fmt: skip
    for p in result["points"]:
        c = p["ours_cold"]
        has_torch = "torch" in p["warm"]
        rows.append((
            str(p["n_params"]),
            f"{p['torch_cold_s']:.2f}" if has_torch else "skipped",
            f"{c['min'] * 1e3:.1f}/{c['median'] * 1e3:.1f}/{c['max'] * 1e3:.1f}",
            f"{p['warm']['torch']['median'] * 1e3:.1f}" if has_torch else "skipped",
            f"{p['warm']['ours']['median'] * 1e3:.1f}",
            _interval(p["ratio"]) if has_torch else "-",
            _interval(p["aa"]) if has_torch else "-",
            _interval(p["cold_over_warm"]) if "cold_over_warm" in p
            else f"{p['ours_cold_over_warm_derived']:.2f}",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["  ".join(c.rjust(w) if i in (0, 1, 3, 4) else c.ljust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
             for r in rows]  # fmt: skip
    table.insert(1, "-" * len(table[0]))
    tail = [ln for ln in md[md.index("| ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | ---: |") + 1 :]
            if not ln.startswith("|")]  # fmt: skip
    wrapped = [w for ln in tail for w in (textwrap.wrap(ln, width=118) if ln.strip() else [""])]
    return "\n".join([*head, "", *table, *wrapped])


def add_host_arguments(parser: argparse.ArgumentParser) -> None:
    """The host table's options (``shardscale bench host``)."""
    a = parser.add_argument
    a("--points", default=None, help="comma list of parameter counts (default 500,1000,2000,4000,"
      "8000,20000)")  # fmt: skip
    a("--rounds", type=int, default=None, help="warm rounds per point (default 24)")
    a("--cold-repeats", type=int, default=None, help="ours' cold samples per point (default 7)")
    a("--torch-budget", type=float, default=None, help="seconds for torch's cold calls beyond "
      "--torch-max (default 240)")  # fmt: skip
    a("--torch-max", type=int, default=None, help="torch runs at every point up to this many "
      "parameters (default 4000)")  # fmt: skip
    a("--clock", choices=("wall", "cpu"), default=None, help="wall (default) or cpu time")
    a("--quick", action="store_true", help="smoke run: 2 small points, 6 rounds (no verdicts)")
    a("--out", type=Path, default=None, metavar="DIR", help="folder for host.json")
    a("--json", action="store_true", help="print the result as JSON on stdout instead of the table")
    a("--markdown", action="store_true", help="print the table as Markdown (docs/benchmark.md)")
    a("--from-json", type=Path, default=None, metavar="FILE",
      help="print the table of an earlier run instead of running")  # fmt: skip


def host_config(args: argparse.Namespace) -> HostConfig:
    """The :class:`HostConfig` the options ask for; ValueError (one line) when one is bad."""
    fields: dict[str, Any] = {}
    if args.quick:
        fields.update(points=(50, 100), rounds=6, resamples=200, cold_repeats=5, growth_base=50)
    if args.points:
        try:
            fields["points"] = tuple(int(x) for x in args.points.split(","))
        except ValueError:
            raise ValueError(
                f"--points needs a comma list of whole numbers, got {args.points!r}"
            ) from None
    for name, value in (("rounds", args.rounds), ("cold_repeats", args.cold_repeats),
                        ("torch_budget_s", args.torch_budget), ("torch_max", args.torch_max),
                        ("clock", args.clock)):  # fmt: skip
        if value is not None:
            fields[name] = value
    cfg = HostConfig(**fields)
    cfg.check()
    return cfg


def run_host_command(args: argparse.Namespace, *, prog: str = "shardscale bench host") -> int:
    """Run (or print) the host table as the options say; 2 on a bad option, else 0."""
    out, human = sys.stdout, sys.stderr if args.json else sys.stdout
    if args.from_json is not None:
        try:
            result = json.loads(args.from_json.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            print(f"{prog}: error: --from-json {args.from_json}: {exc}", file=sys.stderr)
            return 2
    else:
        try:
            cfg = host_config(args)
        except ValueError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        if args.out is not None and args.out.exists() and not args.out.is_dir():
            print(f"{prog}: error: --out {args.out}: exists and is not a folder", file=sys.stderr)
            return 2
        print(f"{prog}: {cfg.world_size} processes, points {', '.join(map(str, cfg.points))}"
              f"{' (smoke run)' if args.quick else ''}", file=sys.stderr, flush=True)  # fmt: skip
        result = run_host(cfg, progress=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=1), file=out)
    else:
        smoke = result["config"]["rounds"] < MIN_VERDICT_SAMPLES
        text = format_host(result) if args.markdown else format_host_text(result)
        print((SMOKE_RUN + "\n" if smoke else "") + text, file=human)
    if args.out is not None and args.from_json is None:
        from shardscale.cli.bench._report import write_json

        args.out.mkdir(parents=True, exist_ok=True)
        path = write_json(result, args.out / "host.json")
        print(f"\njson: {path}", file=human, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m shardscale.cli.bench._host [options]``: the same as ``shardscale bench host``."""
    parser = argparse.ArgumentParser(
        prog="shardscale bench host", description=__doc__.splitlines()[0]
    )
    add_host_arguments(parser)
    return run_host_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
