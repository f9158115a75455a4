"""``shardscale bench --policies``: what each skip policy of the scaler costs per step.

[Note: the policy-cost benchmark]
One FSDP2 model (1-D mesh over every rank), one copy per arm, fed the same
data; every arm runs ``scale(loss).backward()`` and then ``unscale_and_clip_``
+ ``step`` + ``update``, and differs only in the scaler's options:

* ``none``: the fp16 scaler with no policy (the reference), and ``none_aa``,
  the same again: their ratio is the run's noise floor (the A/A line);
* ``no_scaling``: ``loss_scaling=False`` (the scale stays 1, same guard);
* ``spike``: ``spike=SpikeSkip()`` (its defaults);
* ``loss``: the loss's finiteness rides in the step's vector;
* ``streak``: ``max_consecutive_skips`` (never reached here);
* ``all``: every policy at once (without loss scaling).

The arms run interleaved in the balanced order of ``_order`` (drift of a shared
machine hits every arm alike), whole steps are timed (forward + backward +
post-processing, the slowest rank's time per round), and each arm's median is
compared with ``none`` by a ratio with a 95 % paired bootstrap interval
(``_stats``). The data is clean, so no step is skipped: what is measured is
the price of *deciding*, paid on every step. After the timed rounds one more
step per arm counts its collectives with the ``counting`` middleware (the
claim: still 1) and the aten ops post-processing dispatches on this rank (a
policy's added device work, free of timing noise; each is a tiny kernel on a
GPU, a few microseconds of host time on a CPU).
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TextIO

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardscale.cli.bench._config import BenchConfig
from shardscale.cli.bench._order import balanced_order, rounds_for
from shardscale.cli.bench._stats import median, ratio_interval

if TYPE_CHECKING:
    from shardscale.cli.bench._launch import RankFiles

__all__ = ["POLICY_ARMS", "format_policies", "run_policies"]

#: The arms, in the order the table lists them (``none`` is the reference).
POLICY_ARMS = ("none", "none_aa", "no_scaling", "spike", "loss", "streak", "all")
_LABEL = {
    "none": "no policy (fp16 scaling)",
    "none_aa": "no policy again (A/A)",
    "no_scaling": "loss_scaling=False",
    "spike": "spike=SpikeSkip()",
    "loss": "loss check",
    "streak": "max_consecutive_skips=1000",
    "all": "all (no scaling + spike + loss + streak)",
}


def _policy_options() -> dict[str, dict[str, Any]]:
    """Each arm's extra ``ShardedGradScaler`` options (built fresh: a SpikeSkip holds state)."""
    from shardscale.core import SpikeSkip

    return {
        "none": {},
        "none_aa": {},
        "no_scaling": {"loss_scaling": False},
        "spike": {"spike": SpikeSkip()},
        "loss": {"check_loss": True},
        "streak": {"max_consecutive_skips": 1000},
        "all": {
            "loss_scaling": False,
            "spike": SpikeSkip(),
            "check_loss": True,
            "max_consecutive_skips": 1000,
        },
    }


def _arm_steps(cfg: BenchConfig) -> dict[str, Any]:
    """Time every arm on this rank; the result is the same on every rank."""
    import torch.distributed as dist

    from shardscale.cli.bench._arms import counting_spec
    from shardscale.cli.bench._workload import Net, make_optimizer, shard
    from shardscale.clip import unscale_and_clip_
    from shardscale.collectives import CountingMiddleware, find_middleware
    from shardscale.core import ShardedGradScaler

    world = dist.get_world_size()
    device = cfg.torch_device()
    torch.manual_seed(0)
    base = Net(width=cfg.width, hidden=cfg.hidden, blocks=cfg.blocks).to(device)
    options = _policy_options()
    arms: list[tuple[str, torch.nn.Module, torch.optim.Optimizer, Any]] = []
    dp_rank = 0
    for name in POLICY_ARMS:
        sharded, dp_rank = shard(copy.deepcopy(base), (world,), cfg.device)
        opt = make_optimizer(cfg.optimizers[0], sharded.parameters())
        scaler = ShardedGradScaler(
            cfg.device, backend=counting_spec(cfg.backend), **_scaling(options[name])
        )
        arms.append((name, sharded, opt, scaler))
    del base

    def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
        # The same data for every arm in a round; each rank its own.
        gen = torch.Generator().manual_seed(1000 * step + dp_rank)
        x = torch.randn(cfg.batch, cfg.width, generator=gen).to(device)
        out: torch.Tensor = model(x).float().pow(2).mean()
        return out

    def post(scaler: Any, opt: torch.optim.Optimizer) -> None:
        unscale_and_clip_(scaler, opt, cfg.max_norm)
        scaler.step(opt)
        scaler.update()

    def sync() -> None:
        if cfg.device == "cuda":
            torch.cuda.synchronize()

    warm, measured = cfg.warmup, rounds_for(cfg.steps, len(arms))
    order = balanced_order(len(arms), warm + measured)
    times = torch.zeros(len(arms), measured, 2, dtype=torch.float64)  # [arm, round, (post, step)]
    for rnd, row in enumerate(order):
        for index in row:
            _, model, opt, scaler = arms[index]
            dist.barrier()
            sync()
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss_of(model, rnd)).backward()
            sync()
            backward_end = time.perf_counter()
            dist.barrier()  # ranks start post-processing together; not timed
            post_start = time.perf_counter()
            post(scaler, opt)
            sync()
            end = time.perf_counter()
            if rnd >= warm:
                fb, pp = backward_end - start, end - post_start
                times[index, rnd - warm] = torch.tensor([pp, fb + pp], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    out: dict[str, Any] = {"rounds": measured, "warmup_rounds": warm, "arms": {}}
    for i, (name, model, opt, scaler) in enumerate(arms):
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss_of(model, warm + measured)).backward()
        counting = find_middleware(scaler.backend, CountingMiddleware)
        counting.reset()
        with _OpCounter() as ops:
            post(scaler, opt)
        skipped = scaler.last_step_skipped
        out["arms"][name] = {
            "post_ms": (times[i, :, 0] * 1e3).tolist(),
            "step_ms": (times[i, :, 1] * 1e3).tolist(),
            "collectives": len(counting.records),
            "ops": ops.count,
            "skipped_after": bool(skipped) if skipped is not None else False,
        }
    return out


class _OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the aten ops post-processing dispatches: a policy's cost without timing noise."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _scaling(options: dict[str, Any]) -> dict[str, Any]:
    # A scaling arm starts at 2**10 and never grows during a run (as the main benchmark's).
    if options.get("loss_scaling", True):
        return {"init_scale": 2.0**10, "growth_interval": 10_000, **options}
    return options


def _worker(rank: int, files: RankFiles, cfg: BenchConfig) -> None:
    from shardscale.cli.bench._launch import exit_worker, rank_output_to_log, worker_group

    rank_output_to_log(files, rank)
    with worker_group(rank, cfg, files.store):
        result = _arm_steps(cfg)
        if rank == 0:
            result["torch_num_threads"] = torch.get_num_threads()
            with open(files.result, "w") as fh:
                json.dump(result, fh)
    exit_worker()


def run_policies(cfg: BenchConfig, *, progress: TextIO | None = None) -> dict[str, Any]:
    """Run the policy arms in ``cfg.world_size`` fresh processes; analysed results.

    Uses ``cfg``'s model size, rounds, warm-up, first optimizer, ``max_norm``,
    backend and bootstrap settings (see [Note: the policy-cost benchmark]).
    """
    from shardscale.cli.bench._launch import _environment, run_ranks

    env = _environment(cfg)
    started = time.time()
    raw = run_ranks(_worker, (cfg,), cfg.world_size, stream=progress)
    env["torch_num_threads"] = raw.pop("torch_num_threads")
    try:
        env["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        env["load_average_end"] = None
    ref = raw["arms"]["none"]
    for name, rec in raw["arms"].items():
        rec["median_post_ms"] = median(rec["post_ms"])
        rec["median_step_ms"] = median(rec["step_ms"])
        rec["extra_post_ms"] = rec["median_post_ms"] - median(ref["post_ms"])
        if name != "none":
            for metric in ("post", "step"):
                rec[f"{metric}_ratio"] = ratio_interval(
                    rec[f"{metric}_ms"], ref[f"{metric}_ms"], seed=cfg.seed,
                    resamples=cfg.resamples,
                ).as_dict()  # fmt: skip
    return {
        "schema": 1,
        "kind": "policies",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "elapsed_s": time.time() - started,
        "config": {**asdict(cfg), "n_params": cfg.n_params()},
        "environment": env,
        **raw,
    }


def _ci(r: dict[str, Any] | None) -> str:
    if r is None:
        return "1 (reference)"
    return f"{r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}] {r['verdict']}"


def _cells(rec: dict[str, Any], name: str) -> list[str]:
    return [
        _LABEL.get(name, name),
        f"{rec['median_post_ms']:.2f}",
        _ci(rec.get("post_ratio")),
        f"{rec['extra_post_ms']:+.2f}",
        f"{rec['median_step_ms']:.2f}",
        _ci(rec.get("step_ratio")),
        str(rec.get("ops", "")),
        str(rec["collectives"]),
    ]


def format_policies(result: dict[str, Any], *, markdown: bool = False) -> str:
    """The table of a :func:`run_policies` result (Markdown for the docs with ``markdown``)."""
    cfg, env = result["config"], result["environment"]
    head = (
        f"Policy cost, run of {result['started']}: {cfg['n_params'] / 1e6:.2f}M parameters, FSDP2 "
        f"over {cfg['world_size']} ranks ({env['collective_library']}), {cfg['optimizers'][0]}, "
        f"{env['device']}, {env['cpu_count']} CPUs, load average {env['load_average_start']} at "
        f"the start, torch {env['torch']}, {result['rounds']} interleaved rounds per arm "
        "(post = unscale_and_clip_ + step + update; step = forward + backward + post)"
    )
    cols = ("arm", "post ms", "post ratio [95 % CI]", "extra post ms", "step ms",
            "step ratio [95 % CI]", "aten ops in post", "collectives / step")  # fmt: skip
    rows = [_cells(rec, name) for name, rec in result["arms"].items()]
    if markdown:
        lines = [head, "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = [head, "", "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)
