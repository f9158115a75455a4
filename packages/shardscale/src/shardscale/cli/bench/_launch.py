"""Start the ranks, run every configuration and the scaling table, collect one result dict."""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, NoReturn

import torch

from shardscale.cli.bench._config import BenchConfig, check_config

__all__ = ["exit_worker", "run_benchmark", "worker_group"]


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _progress(rank: int, text: str) -> None:
    if rank == 0:  # stderr: stdout carries only the tables
        print(f"  {text}", file=sys.stderr, flush=True)


def _worker(rank: int, cfg: BenchConfig, store_path: str, result_path: str) -> None:
    import logging

    from shardscale.cli.bench._harness import run_config
    from shardscale.cli.bench._scaling import run_scaling

    # DTensor warns on every multi-dim redistribute of torch's recipe; the table says it better.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    with worker_group(rank, cfg, store_path):
        started = time.perf_counter()
        rows = []
        for mesh in cfg.meshes if cfg.rows else ():
            for opt in cfg.optimizers:
                rows.append(run_config(cfg, mesh, opt))
                _progress(rank, f"{mesh} {opt}: done after {time.perf_counter() - started:.0f} s")
        rows_s = time.perf_counter() - started
        scaling = run_scaling(cfg) if cfg.scaling_points else None
        _progress(rank, f"scaling table: done after {time.perf_counter() - started:.0f} s")
        if rank == 0:
            result = {
                "rows": rows,
                "scaling": scaling,
                "worker": {
                    "torch_num_threads": torch.get_num_threads(),
                    "rows_elapsed_s": rows_s,
                    "load_average_end": _load(),
                },
            }
            with open(result_path, "w") as fh:
                json.dump(result, fh)
    exit_worker()


@contextmanager
def worker_group(rank: int, cfg: BenchConfig, store_path: str) -> Iterator[None]:
    """One benchmark worker's threads, device and process group, torn down on the way out."""
    import torch.distributed as dist

    threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // cfg.world_size)
    torch.set_num_threads(threads)
    if cfg.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        "nccl" if cfg.device == "cuda" else "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=cfg.world_size,
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def exit_worker() -> NoReturn:
    """Leave a worker process once its results are on disk."""
    # gloo's background threads sometimes abort interpreter shutdown ("terminate called without
    # an active exception"); the results are on disk, so leave without running destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _environment(cfg: BenchConfig) -> dict[str, Any]:
    return {
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "device": cfg.device if cfg.device == "cpu" else torch.cuda.get_device_name(0),
        "collective_library": "nccl" if cfg.device == "cuda" else "gloo",
        "world_size": cfg.world_size,
        "load_average_start": _load(),
    }


def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Run ``cfg`` in ``cfg.world_size`` fresh processes and return the raw results.

    The dict has ``config``, ``environment``, ``rows`` (one per mesh and
    optimizer, every sample of every arm) and ``scaling``; summarise it with
    :func:`shardscale.cli.bench.analyse`. Raises
    :class:`~shardscale.cli.bench.BenchOptionError` before starting anything
    when an option cannot run.
    """
    check_config(cfg)
    from torch.multiprocessing.spawn import spawn

    env = _environment(cfg)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="shardscale-bench-") as tmpdir:
        store, result_path = os.path.join(tmpdir, "store"), os.path.join(tmpdir, "result.json")
        spawn(_worker, args=(cfg, store, result_path), nprocs=cfg.world_size, join=True)  # type: ignore[no-untyped-call]
        with open(result_path) as fh:
            raw = json.load(fh)
    worker = raw.pop("worker")
    env["torch_num_threads"] = worker["torch_num_threads"]
    env["load_average_end"] = worker["load_average_end"]
    return {
        "schema": 1,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "elapsed_s": time.time() - started,
        "config": {**asdict(cfg), "n_params": cfg.n_params()},
        "environment": env,
        **raw,
    }
