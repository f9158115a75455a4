"""Start the ranks, run every configuration and the scaling table, collect one result dict.

[Note: quiet ranks]
:func:`run_ranks` starts the ranks of every benchmark (this one, ``--policies``
and the host table) with one temporary folder: the file store, the result
JSON, rank 0's progress events (``_progress``) and one log per rank. Each
rank sends its stdout and stderr to its log (:func:`rank_output_to_log`), so
the terminal shows only the parent's lines: the progress and the tables. When
a rank fails, the end of every rank's log is printed before the error.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn, TextIO

import torch

from shardscale.cli.bench._config import BenchConfig, check_config

__all__ = [
    "RankFiles",
    "exit_worker",
    "rank_output_to_log",
    "run_benchmark",
    "run_ranks",
    "worker_group",
]

#: The progress bars' titles, by task.
TITLES = {"rows": "timed rounds", "scaling": "scaling table", "points": "host table"}


class RankFiles:
    """The files of one run's temporary folder, as every rank and the parent name them."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.store = os.path.join(folder, "store")
        self.result = os.path.join(folder, "result.json")
        self.progress = os.path.join(folder, "progress.jsonl")

    def log(self, rank: int) -> str:
        """Rank ``rank``'s stdout and stderr."""
        return os.path.join(self.folder, f"rank{rank}.log")


def rank_output_to_log(files: RankFiles, rank: int) -> None:
    """Send this process's stdout and stderr (Python's and C's) to its rank's log."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(files.log(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _log_tails(files: RankFiles, nprocs: int, lines: int = 20) -> str:
    out = []
    for rank in range(nprocs):
        try:
            with open(files.log(rank), encoding="utf-8", errors="replace") as fh:
                text = fh.read().strip().splitlines()[-lines:]
        except FileNotFoundError:
            continue
        if text:
            out.append(f"--- rank {rank} (last {len(text)} lines of its output) ---")
            out += text
    return "\n".join(out)


def run_ranks(
    worker: Callable[..., None],
    args: tuple[Any, ...],
    nprocs: int,
    *,
    stream: TextIO | None,
) -> dict[str, Any]:
    """Run ``worker(rank, files, *args)`` in ``nprocs`` fresh processes; rank 0's result JSON.

    Shows rank 0's progress on ``stream`` (None: nothing) while waiting; see
    [Note: quiet ranks] and [Note: progress from the ranks].
    """
    from torch.multiprocessing.spawn import spawn

    from shardscale.cli.bench._launches import quiet_kineto
    from shardscale.cli.bench._progress import ProgressView, read_events

    quiet_kineto()  # inherited by the ranks: set before any of them profiles
    with tempfile.TemporaryDirectory(prefix="shardscale-bench-") as tmpdir:
        files = RankFiles(tmpdir)
        ctx = spawn(worker, args=(files, *args), nprocs=nprocs, join=False)  # type: ignore[no-untyped-call]
        try:
            if stream is None:
                while not ctx.join(timeout=0.25):
                    pass
            else:
                with ProgressView(TITLES, stream=stream) as view:
                    view.note(f"  starting {nprocs} processes (imports and process group first)")
                    offset, done = 0, False
                    while not done:
                        done = ctx.join(timeout=0.25)  # raises when a rank failed
                        events, offset = read_events(Path(files.progress), offset)
                        view.show(events)
        except Exception:
            tails = _log_tails(files, nprocs)
            if tails:
                print(tails, file=sys.stderr, flush=True)
            raise
        with open(files.result) as fh:
            result: dict[str, Any] = json.load(fh)
    return result


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _worker(rank: int, files: RankFiles, cfg: BenchConfig) -> None:
    import logging

    from shardscale.cli.bench._harness import rounds_per_config, run_config
    from shardscale.cli.bench._progress import ProgressFile
    from shardscale.cli.bench._scaling import run_scaling

    rank_output_to_log(files, rank)
    # DTensor warns on every multi-dim redistribute of torch's recipe; the table says it better.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    progress = ProgressFile(files.progress, enabled=rank == 0)
    with worker_group(rank, cfg, files.store):
        started = time.perf_counter()
        rows = []
        configs = [(m, o) for m in (cfg.meshes if cfg.rows else ()) for o in cfg.optimizers]
        per = rounds_per_config(cfg)
        for k, (mesh, opt) in enumerate(configs):
            rows.append(run_config(cfg, mesh, opt, progress=progress, done_before=k * per,
                                   total=len(configs) * per))  # fmt: skip
        rows_s = time.perf_counter() - started
        scaling = run_scaling(cfg, progress=progress) if cfg.scaling_points else None
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
            with open(files.result, "w") as fh:
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


def run_benchmark(cfg: BenchConfig, *, progress: TextIO | None = None) -> dict[str, Any]:
    """Run ``cfg`` in ``cfg.world_size`` fresh processes and return the raw results.

    The dict has ``config``, ``environment``, ``rows`` (one per mesh and
    optimizer, every sample of every arm) and ``scaling``; summarise it with
    :func:`shardscale.cli.bench.analyse`. Raises
    :class:`~shardscale.cli.bench.BenchOptionError` before starting anything
    when an option cannot run. ``progress``: where to show rank 0's progress
    (a live bar on a terminal with rich, plain lines otherwise; None: nowhere).
    """
    check_config(cfg)
    env = _environment(cfg)
    started = time.time()
    raw = run_ranks(_worker, (cfg,), cfg.world_size, stream=progress)
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
