"""The scaling table: unscale + clip time against the number of FSDP2 parameters, torch vs ours.

[Note: cold and warm calls]
torch's DTensor dispatch caches sharding propagation per op schema, and a
foreach op over N DTensors has one schema per layout. Its first call on a new
layout (new parameter count or shapes) propagates shardings for all N
tensors, which grows faster than linearly in N (pytorch issue #169445); later
calls on the same layout hit the cache. So the table has two columns per arm:

* cold: the first ``unscale_`` + ``clip_grad_norm_`` (ours: ``unscale_and_clip_``)
  on a model whose layout this process has not seen. Every cold sample gets a
  fresh layout (each parameter has ``numel + 2k`` elements, odd for ours, even
  for torch), so no sample warms another's cache. At least ``cold_repeats``
  samples per arm and point (min / median / max).
* warm: the same call repeated on one layout, gradients restored untimed
  between repeats, the arms alternating ABBA; ratio with a bootstrap interval.

Points run in increasing size; before each, the time it would take is
projected from the previous point (quadratic growth assumed) and the point is
skipped, and reported as skipped, when it would overrun the budget.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from shardscale.cli.bench._arms import make_scaler
from shardscale.cli.bench._bytes import local_tensor
from shardscale.cli.bench._config import BenchConfig
from shardscale.cli.bench._progress import ProgressFile
from shardscale.cli.bench._stats import ratio_interval, summary
from shardscale.cli.bench._workload import TinyParams

__all__ = ["run_scaling"]

_ARMS = ("torch", "ours")


class _Case:
    """One model, optimizer and scaler for one arm."""

    def __init__(
        self, arm: str, count: int, numel: int, mesh: Any, device: str, backend: str
    ) -> None:
        from torch.distributed.fsdp import fully_shard

        self.arm = arm
        self.model = TinyParams(count=count, numel=numel)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.0)
        self.scaler: Any = make_scaler(arm, device, backend)
        self.scaler.scale(self.model()).backward()
        self.saved = [
            local_tensor(p.grad).clone() for p in self.model.parameters() if p.grad is not None
        ]

    def restore(self) -> None:
        grads = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
        for grad, saved in zip(grads, self.saved, strict=True):
            grad.copy_(saved)

    def timed(self, max_norm: float) -> float:
        """Seconds for unscale + clip on every rank (the slowest rank's time); update untimed."""
        import torch.distributed as dist

        dist.barrier()
        start = time.perf_counter()
        if self.arm == "ours":
            from shardscale.clip import unscale_and_clip_

            # The multiply done here (not folded into the untimed step), like torch's recipe.
            unscale_and_clip_(self.scaler, self.opt, max_norm, fuse_optimizer=False)
        else:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        self.scaler.update()  # resets the per-optimizer state for the next call
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # every rank decides on the same numbers
        return float(took.item())


def _point(cfg: BenchConfig, count: int, mesh: Any) -> dict[str, Any]:
    cold: dict[str, list[float]] = {a: [] for a in _ARMS}
    warm: dict[str, list[float]] = {a: [] for a in _ARMS}
    keep: dict[str, _Case] = {}
    for k in range(cfg.cold_repeats):
        arms = _ARMS if k % 2 == 0 else _ARMS[::-1]
        for arm in arms:
            numel = cfg.scaling_param_numel + 2 * k + (1 if arm == "ours" else 0)
            case = _Case(arm, count, numel, mesh, cfg.device, cfg.backend)
            cold[arm].append(case.timed(cfg.max_norm))
            if k == 0:
                keep[arm] = case  # its layout is warm from now on
    for rep in range(cfg.repeats):
        for arm in _ARMS if rep % 4 in (0, 3) else _ARMS[::-1]:  # ABBA
            keep[arm].restore()
            warm[arm].append(keep[arm].timed(cfg.max_norm))
    out: dict[str, Any] = {"n_params": count, "arms": {}}
    for arm in _ARMS:
        out["arms"][arm] = {
            "cold_s": cold[arm],
            "warm_s": warm[arm],
            "cold": summary(cold[arm]),
            "warm": summary(warm[arm]),
        }
    out["warm_ratio"] = ratio_interval(
        warm["ours"], warm["torch"], seed=cfg.seed, resamples=cfg.resamples
    ).as_dict()
    # Three cold samples are too few for an interval: the ratio of medians, labelled derived.
    out["cold_ratio_derived"] = (
        out["arms"]["ours"]["cold"]["median"] / out["arms"]["torch"]["cold"]["median"]
    )
    return out


def run_scaling(cfg: BenchConfig, *, progress: ProgressFile | None = None) -> dict[str, Any]:
    """Every scaling point that fits the budget, on a 1-D mesh over all ranks.

    ``progress`` hears of each point before it starts (never inside a timed call).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh(cfg.device, (world,), mesh_dim_names=("dp",))
    started = time.perf_counter()
    points: list[dict[str, Any]] = []
    last: tuple[int, float] | None = None
    counts = sorted(cfg.scaling_points)
    for k, count in enumerate(counts):
        if progress is not None:
            progress.event("scaling", label=f"{count} parameters", done=k, total=len(counts),
                           budget_s=cfg.scaling_budget_s)  # fmt: skip
        if last is not None:
            n_last, took_last = last
            # Every rank must take the same decision: decide on the slowest rank's clock.
            clock = torch.tensor([time.perf_counter() - started, took_last], dtype=torch.float64)
            dist.all_reduce(clock, op=dist.ReduceOp.MAX)
            elapsed, took_last = clock.tolist()
            projected = took_last * (count / n_last) ** 2
            left = cfg.scaling_budget_s - elapsed
            if projected > left:
                points.append({
                    "n_params": count,
                    "skipped": f"projected {projected:.0f} s exceeds the {left:.0f} s left of "
                    f"the {cfg.scaling_budget_s:.0f} s budget",
                })  # fmt: skip
                continue
        t0 = time.perf_counter()
        points.append(_point(cfg, count, mesh))
        last = (count, time.perf_counter() - t0)
    if progress is not None:
        progress.event("scaling", label="done", done=len(counts), total=len(counts),
                       budget_s=cfg.scaling_budget_s)  # fmt: skip
    return {
        "mesh_shape": [world],
        "param_numel": cfg.scaling_param_numel,
        "cold_repeats": cfg.cold_repeats,
        "warm_repeats": cfg.repeats,
        "budget_s": cfg.scaling_budget_s,
        "elapsed_s": time.perf_counter() - started,
        "points": points,
    }
