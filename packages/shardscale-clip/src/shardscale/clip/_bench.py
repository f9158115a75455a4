"""Benchmark: torch's ``unscale_`` + ``clip_grad_norm_`` against ``unscale_and_clip_``, side by side.

[Note: what is measured]
One run, one model, one data stream. On every rank an FSDP2 model (>= 30M
parameters by default) is built twice from the same weights: one copy is
post-processed with torch's recipe (``GradScaler.unscale_``,
``torch.nn.utils.clip_grad_norm_``, ``step``, ``update``), the other with
shardscale's (``unscale_and_clip_``, ``step``, ``update``). Steps alternate
between the two so that drift in machine load hits both alike. Per step:

* post-processing: from the end of backward (after a barrier, so ranks start
  together) to the end of ``update()``; the max over ranks. It is timed
  ``repeats`` times on the gradients of one backward, saved once and restored
  (untimed) before each run, because whole FSDP steps on CPU are slow and
  noisy and the post-processing is a small part of them; the same quantity
  measured inside the whole steps is in the JSON as ``post_ms_in_steps``;
* the whole step: forward + backward + post-processing (the barrier excluded),
  over ``steps`` real training steps;
* collectives issued during post-processing, counted with torch's
  ``CommDebugMode`` for both recipes in separate, untimed steps;
* bytes of gradient memory read and written by the post-processing, from the
  number of passes each recipe makes over this rank's local gradients (the
  optimizer's own read of the gradients is the same for both and left out);
* on CUDA, host-device synchronisations counted with
  ``torch.cuda.set_sync_debug_mode``.

Medians are reported and the ratio ours / torch is taken within the run:
absolute times on shared machines mean little, ratios measured side by side do.

The code lives here (not in the tests) so that ``nox -s bench`` and the
``shardscale bench`` command run the same thing: :func:`run_benchmark`
returns the results as a dict, :func:`main` prints the table and writes JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["BenchConfig", "format_table", "main", "run_benchmark"]

_RECIPES = ("torch", "ours", "ours_streaming")


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """What to run. The defaults give a 33.6M-parameter model and finish in about two minutes."""

    world_size: int = 2
    steps: int = 5
    warmup: int = 2
    repeats: int = 15
    width: int = 1024
    hidden: int = 4096
    blocks: int = 4
    batch: int = 8
    meshes: tuple[str, ...] = ("1d", "2d")
    optimizers: tuple[str, ...] = ("sgd", "adam_fused")
    max_norm: float = 1.0
    streaming: bool = True
    device: str = "cpu"
    threads_per_rank: int = 0  # 0: the CPU count divided by the world size

    def n_params(self) -> int:
        """Parameters of the benchmark model."""
        return self.blocks * (2 * self.width * self.hidden + self.width + self.hidden)


# -- the model ------------------------------------------------------------------------------------


class _Block(nn.Module):
    """A residual MLP block: the up projection is split by columns under TP, the down by rows."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.nn.functional.gelu(self.up(x)))
        return out


class _Net(nn.Module):
    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(cfg.width, cfg.hidden) for _ in range(cfg.blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _shard(model: nn.Module, mesh_kind: str, world: int, device: str) -> tuple[nn.Module, int]:
    """Apply FSDP2 (1-D) or TP + FSDP2 (2-D) in place; return the model and this rank's dp index."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Keeping parameters gathered between forward and backward saves one all-gather per step:
    # the benchmark is about what happens after backward, and the run must stay short.
    reshard = False
    if mesh_kind == "1d":
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return model, mesh.get_local_rank()
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = 2 if world % 2 == 0 else 1
    mesh = init_device_mesh(device, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:  # type: ignore[union-attr]
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=reshard)
    return model, mesh["dp"].get_local_rank()


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=True)
    if name == "adam_fused":
        return torch.optim.Adam(params, lr=1e-4, fused=True)
    raise ValueError(f"unknown optimizer {name!r}; choose from 'sgd', 'adam_fused'")


# -- one benchmark configuration on one rank ------------------------------------------------------


@dataclass(slots=True)
class _Arm:
    """One recipe: its model copy, optimizer, scaler and post-processing function."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    post: Callable[[], None]
    scaler: Any = None
    stream: Any = None
    post_times: list[float] = field(default_factory=list)
    post_only_times: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)


def _local_grads(model: nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = []
    for param in model.parameters():
        grad = param.grad
        if grad is not None:
            out.append(grad._local_tensor if isinstance(grad, DTensor) else grad)
    return out


def _local_grad_bytes(model: nn.Module) -> tuple[int, int]:
    """(every local gradient byte, bytes of the gradients this rank counts) for this rank."""
    from shardscale.clip import _pipeline as pipe
    from shardscale.core import get_registry

    registry = get_registry()
    backend = registry.make_backend(None)
    ctx = pipe.adapter_context(backend, None, ())
    buckets = pipe.collect(model.parameters(), ctx, registry, backend, as_grads=False)

    def size(groups: dict[Any, list[torch.Tensor]]) -> int:
        return sum(t.numel() * t.element_size() for ts in groups.values() for t in ts)

    return size(buckets.every), size(buckets.counted)


def _count_collectives(post: Callable[[], None]) -> int:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:  # type: ignore[no-untyped-call]
        post()
    return int(comm.get_total_counts())


def _count_syncs(post: Callable[[], None], device: str) -> int | None:
    if device != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            post()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # the benchmark's own sync, outside the counted region
    return sum("synchroniz" in str(w.message) for w in caught)


def _run_config(cfg: BenchConfig, mesh_kind: str, opt_name: str) -> dict[str, Any]:
    import torch.distributed as dist

    from shardscale.clip import unscale_and_clip_
    from shardscale.clip._streaming import StreamingStats
    from shardscale.core import ShardedGradScaler

    world, rank = dist.get_world_size(), dist.get_rank()
    device = (
        torch.device(cfg.device, torch.cuda.current_device())
        if cfg.device == "cuda"
        else torch.device("cpu")
    )
    torch.manual_seed(0)
    base = _Net(cfg).to(device)
    recipes = [r for r in _RECIPES if cfg.streaming or r != "ours_streaming"]
    arms: list[_Arm] = []
    dp_rank = 0
    for recipe in recipes:
        model, dp_rank = _shard(copy.deepcopy(base), mesh_kind, world, cfg.device)
        opt = _optimizer(opt_name, model.parameters())
        arms.append(_Arm(recipe, model, opt, post=lambda: None))
    del base
    scale_kw: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 10_000}
    for arm in arms:
        if arm.name == "torch":
            tscaler = torch.amp.GradScaler(cfg.device, **scale_kw)

            def torch_post(arm: _Arm = arm, scaler: Any = tscaler) -> None:
                scaler.unscale_(arm.opt)
                torch.nn.utils.clip_grad_norm_(arm.model.parameters(), cfg.max_norm)
                scaler.step(arm.opt)
                scaler.update()

            arm.post, arm.scaler = torch_post, tscaler
        else:
            oscaler = ShardedGradScaler(cfg.device, backend="c10d", **scale_kw)
            stream = (
                StreamingStats(arm.model.parameters(), oscaler)
                if arm.name == "ours_streaming"
                else None
            )

            def our_post(arm: _Arm = arm, scaler: Any = oscaler, stream: Any = stream) -> None:
                unscale_and_clip_(scaler, arm.opt, cfg.max_norm, 2.0, stats=stream)
                scaler.step(arm.opt)
                scaler.update()

            arm.post, arm.stream, arm.scaler = our_post, stream, oscaler

    def batch(step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 * step + dp_rank)
        return torch.randn(cfg.batch, cfg.width, generator=gen).to(device)

    def sync() -> None:
        if cfg.device == "cuda":
            torch.cuda.synchronize()

    def forward_backward(arm: _Arm, step: int) -> None:
        arm.opt.zero_grad(set_to_none=True)
        loss = arm.model(batch(step)).float().pow(2).mean()
        arm.scaler.scale(loss).backward()

    def timed_step(arm: _Arm, step: int, record: bool) -> None:
        sync()
        start = time.perf_counter()
        forward_backward(arm, step)
        sync()
        backward_end = time.perf_counter()
        dist.barrier()  # ranks start post-processing together; not counted anywhere
        post_start = time.perf_counter()
        arm.post()
        sync()
        end = time.perf_counter()
        if record:
            arm.post_times.append(end - post_start)
            arm.step_times.append((backward_end - start) + (end - post_start))

    # Phase A: whole training steps.
    for step in range(cfg.warmup + cfg.steps):
        # Alternate which recipe goes first, so neither always runs on a warmer cache.
        order = arms if step % 2 == 0 else arms[::-1]
        for arm in order:
            timed_step(arm, step, record=step >= cfg.warmup)
    # Phase B: post-processing alone, many times on the same gradients (restored untimed).
    step = cfg.warmup + cfg.steps
    for arm in arms:
        forward_backward(arm, step)
    saved = {arm.name: [g.clone() for g in _local_grads(arm.model)] for arm in arms}
    for rep in range(1 + cfg.repeats):
        for arm in arms if rep % 2 == 0 else arms[::-1]:
            for grad, copy_ in zip(_local_grads(arm.model), saved[arm.name], strict=True):
                grad.copy_(copy_)
            if arm.stream is not None:
                # What the hooks did during backward, done again for these gradients (untimed).
                for param in arm.model.parameters():
                    arm.stream._hook(param)
            sync()
            dist.barrier()
            start = time.perf_counter()
            arm.post()
            sync()
            if rep > 0:
                arm.post_only_times.append(time.perf_counter() - start)
    del saved
    # Untimed steps for the counts.
    out: dict[str, Any] = {"mesh": mesh_kind, "optimizer": opt_name, "recipes": {}}
    local_bytes, counted_bytes = 0, 0
    for arm in arms:
        forward_backward(arm, cfg.warmup + cfg.steps)
        if arm.name == "torch":
            local_bytes, counted_bytes = _local_grad_bytes(arm.model)
        collectives = _count_collectives(arm.post)
        forward_backward(arm, cfg.warmup + cfg.steps + 1)
        syncs = _count_syncs(arm.post, cfg.device)
        in_steps = torch.tensor([arm.post_times, arm.step_times], dtype=torch.float64)
        alone = torch.tensor(arm.post_only_times, dtype=torch.float64)
        for times in (in_steps, alone):
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        out["recipes"][arm.name] = {
            "post_ms": statistics.median(alone.tolist()) * 1e3,
            "post_ms_in_steps": statistics.median(in_steps[0].tolist()) * 1e3,
            "step_ms": statistics.median(in_steps[1].tolist()) * 1e3,
            "collectives": collectives,
            "host_syncs": syncs,
        }
    fused = opt_name == "adam_fused"
    passes = {
        # (reads, writes) of every local grad byte; ours reads only the copies it counts.
        "torch": (3 * local_bytes, 2 * local_bytes),
        "ours": (counted_bytes + (0 if fused else local_bytes), 0 if fused else local_bytes),
        "ours_streaming": (
            counted_bytes + (0 if fused else local_bytes),
            0 if fused else local_bytes,
        ),
    }
    for name, rec in out["recipes"].items():
        rec["grad_bytes_read"], rec["grad_bytes_written"] = passes[name]
    torch_rec = out["recipes"]["torch"]
    for rec in out["recipes"].values():
        rec["post_ratio"] = rec["post_ms"] / torch_rec["post_ms"]
        rec["post_in_steps_ratio"] = rec["post_ms_in_steps"] / torch_rec["post_ms_in_steps"]
        rec["step_ratio"] = rec["step_ms"] / torch_rec["step_ms"]
    out["local_grad_bytes"] = local_bytes
    out["rank"] = rank
    return out


def _worker(rank: int, cfg: BenchConfig, store_path: str, result_path: str) -> None:
    import logging

    import torch.distributed as dist

    # DTensor warns on every multi-dim redistribute of torch's recipe; the table says it better.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // cfg.world_size)
    torch.set_num_threads(threads)
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    if cfg.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=f"file://{store_path}", rank=rank, world_size=cfg.world_size
    )
    try:
        rows = [
            _run_config(cfg, mesh_kind, opt_name)
            for mesh_kind in cfg.meshes
            for opt_name in cfg.optimizers
        ]
        if rank == 0:
            with open(result_path, "w") as fh:
                json.dump(rows, fh)
    finally:
        dist.destroy_process_group()
    # gloo's background threads sometimes abort interpreter shutdown ("terminate called without
    # an active exception"); the results are on disk, so leave without running destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- the public entry points ----------------------------------------------------------------------


def run_benchmark(
    *,
    world_size: int = 2,
    steps: int = 5,
    warmup: int = 2,
    repeats: int = 15,
    width: int = 1024,
    hidden: int = 4096,
    blocks: int = 4,
    batch: int = 8,
    meshes: Sequence[str] = ("1d", "2d"),
    optimizers: Sequence[str] = ("sgd", "adam_fused"),
    max_norm: float = 1.0,
    streaming: bool = True,
    device: str = "cpu",
    threads_per_rank: int = 0,
    json_path: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Run the benchmark in ``world_size`` fresh processes and return the results.

    Returns ``{"config": ..., "environment": ..., "rows": [...]}`` where each row
    is one (mesh, optimizer) with, per recipe (``torch``, ``ours`` and, with
    ``streaming``, ``ours_streaming``): median post-processing and whole-step
    milliseconds, ratios to torch, collectives per step, gradient bytes read
    and written, and host syncs (CUDA only). Writes the dict as JSON to
    ``json_path`` when given. ``device="cuda"`` runs over NCCL, one GPU per rank.
    """
    cfg = BenchConfig(
        world_size=world_size,
        steps=steps,
        warmup=warmup,
        repeats=repeats,
        width=width,
        hidden=hidden,
        blocks=blocks,
        batch=batch,
        meshes=tuple(meshes),
        optimizers=tuple(optimizers),
        max_norm=max_norm,
        streaming=streaming,
        device=device,
        threads_per_rank=threads_per_rank,
    )
    _check_config(cfg)
    from torch.multiprocessing.spawn import spawn

    with tempfile.TemporaryDirectory(prefix="shardscale-bench-") as tmpdir:
        store, result = os.path.join(tmpdir, "store"), os.path.join(tmpdir, "rows.json")
        spawn(_worker, args=(cfg, store, result), nprocs=world_size, join=True)  # type: ignore[no-untyped-call]
        with open(result) as fh:
            rows = json.load(fh)
    out = {
        "config": {**asdict(cfg), "n_params": cfg.n_params()},
        "environment": {
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(),
            "device": device if device == "cpu" else torch.cuda.get_device_name(0),
        },
        "rows": rows,
    }
    if json_path is not None:
        with open(json_path, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


def _check_config(cfg: BenchConfig) -> None:
    if cfg.world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {cfg.world_size}")
    if "2d" in cfg.meshes and cfg.world_size % 2:
        raise ValueError(f"the 2-D mesh needs an even world_size (tp=2), got {cfg.world_size}")
    for mesh in cfg.meshes:
        if mesh not in ("1d", "2d"):
            raise ValueError(f"unknown mesh {mesh!r}; choose from '1d', '2d'")
    for opt in cfg.optimizers:
        _optimizer(opt, [nn.Parameter(torch.zeros(1))])
    if cfg.steps < 1 or cfg.warmup < 0 or cfg.repeats < 1:
        raise ValueError(
            f"steps and repeats must be >= 1 and warmup >= 0, got {cfg.steps}, {cfg.repeats}, "
            f"{cfg.warmup}"
        )
    if cfg.device == "cuda" and torch.cuda.device_count() < cfg.world_size:
        raise ValueError(
            f"device='cuda' needs {cfg.world_size} GPUs, found {torch.cuda.device_count()}"
        )
    if cfg.device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {cfg.device!r}")
    from shardscale.core import get_registry

    registry = get_registry()
    missing = [
        dist
        for dist, kind, name in (
            ("shardscale-collectives", "backend", "c10d"),
            ("shardscale-fsdp", "adapter", "dtensor"),
        )
        if name not in registry.names(kind)
    ]
    if missing:
        raise ValueError(
            f"the benchmark runs FSDP2 over several processes and needs {', '.join(missing)}: "
            "pip install 'shardscale-clip[bench]'"
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def format_table(result: dict[str, Any]) -> str:
    """The results as a plain-text table (one line per mesh, optimizer and recipe)."""
    cfg = result["config"]
    lines = [
        f"shardscale-clip benchmark: {cfg['n_params'] / 1e6:.1f}M parameters, FSDP2, world size "
        f"{cfg['world_size']}, {result['environment']['device']}, torch "
        f"{result['environment']['torch']}",
        f"post = end of backward -> end of update(), median of {cfg['repeats']} runs; "
        f"step = forward + backward + post, median of {cfg['steps']} steps;",
        "coll. = collectives per step; grad MiB = this rank's gradient memory read / written "
        "by post-processing (the optimizer's own read excluded)",
        "",
    ]
    header = (
        f"{'mesh':<5}{'optimizer':<12}{'recipe':<16}{'post ms':>9}{'ratio':>7}"
        f"{'step ms':>10}{'ratio':>7}{'coll.':>7}{'grad MiB R/W':>14}{'syncs':>7}"
    )
    lines += [header, "-" * len(header)]
    for row in result["rows"]:
        for name, rec in row["recipes"].items():
            syncs = "-" if rec["host_syncs"] is None else str(rec["host_syncs"])
            lines.append(
                f"{row['mesh']:<5}{row['optimizer']:<12}{name:<16}{rec['post_ms']:>9.1f}"
                f"{rec['post_ratio']:>7.2f}{rec['step_ms']:>10.1f}{rec['step_ratio']:>7.2f}"
                f"{rec['collectives']:>7}"
                f"{_mib(rec['grad_bytes_read']) + '/' + _mib(rec['grad_bytes_written']):>14}"
                f"{syncs:>7}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the benchmark, print the table, write the JSON file."""
    parser = argparse.ArgumentParser(
        prog="shardscale-clip-bench",
        description="torch's unscale_ + clip_grad_norm_ against shardscale's unscale_and_clip_",
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed whole training steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--repeats", type=int, default=15, help="timed post-processing runs on saved gradients"
    )
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--meshes", default="1d,2d", help="comma list of 1d, 2d")
    parser.add_argument(
        "--optimizers", default="sgd,adam_fused", help="comma list of sgd, adam_fused"
    )
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--no-streaming", action="store_true", help="skip the streaming variant")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads-per-rank", type=int, default=0)
    parser.add_argument("--json", default="bench-clip.json", help="where to write the results")
    args = parser.parse_args(argv)
    result = run_benchmark(
        world_size=args.world_size,
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        width=args.width,
        hidden=args.hidden,
        blocks=args.blocks,
        batch=args.batch,
        meshes=[m for m in args.meshes.split(",") if m],
        optimizers=[o for o in args.optimizers.split(",") if o],
        max_norm=args.max_norm,
        streaming=not args.no_streaming,
        device=args.device,
        threads_per_rank=args.threads_per_rank,
        json_path=args.json,
    )
    print(format_table(result))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
