"""``shardscale demo``: start the training script on N local processes and show it train.

[Note: why subprocesses with torchrun's variables]
The demo starts ``python -m shardscale.cli.train`` once per rank with the same
environment variables ``torchrun`` would set (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ...), so what the demo runs
is exactly what a user runs under ``torchrun``. Rank 0 prints one JSON event
per step on its stdout; this process turns them into the progress bar, so the
progress bar, the summary table and the plot need rich/matplotlib only here.
Other ranks write to log files under ``<out>/logs``; if any rank fails, every
rank is stopped and the failing rank's log is shown.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, TextIO

__all__ = ["add_demo_parser", "run_demo"]


def add_demo_parser(sub: Any) -> argparse.ArgumentParser:
    """Register the ``demo`` subcommand."""
    from shardscale.cli._trainer import TrainConfig
    from shardscale.cli.train import add_training_options

    p: argparse.ArgumentParser = sub.add_parser(
        "demo",
        help="train a small transformer on 2 local processes and plot it",
        description="Train a small decoder-only transformer on Shakespeare's Sonnets, "
        "FSDP2-sharded over local processes, with fp16 autocast, ShardedGradScaler and "
        "unscale_and_clip_. Shows progress, a summary table, and writes a PNG plot.",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="number of processes (default 2, or the size --mesh asks for)",
    )
    add_training_options(p, TrainConfig())
    p.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="stop every rank after this many seconds (default 1800)",
    )
    p.add_argument(
        "--plain", action="store_true", help="plain text output even if rich is installed"
    )
    p.set_defaults(func=run_demo)
    return p


def _world_size(args: argparse.Namespace) -> int:
    from shardscale.cli._distributed import mesh_shape, parse_mesh

    if args.world_size is not None:
        if args.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
        parse_mesh(args.mesh, args.world_size)  # a mismatch names both numbers
        return int(args.world_size)
    return mesh_shape(args.mesh).size if args.mesh else 2


def _check_backend(spec: str | None) -> None:
    if spec is None:
        return
    from shardscale.core import get_registry

    reg = get_registry()
    *middle, last = [p.strip() for p in spec.split("+")]
    known_backends, known_mw = reg.names("backend"), reg.names("middleware")
    bare = last.rpartition(":")[2]
    if bare not in known_backends:
        raise ValueError(
            f"--backend {spec!r}: no backend named {last!r}. Installed backends: "
            f"{', '.join(known_backends) or '(none)'}; middleware: {', '.join(known_mw) or '(none)'}. "
            "Run 'shardscale plugins' to see what is usable here."
        )
    unusable = [i for i in reg.items() if i.kind == "backend" and i.name == bare and not i.usable]
    if unusable:
        raise ValueError(
            f"--backend {spec!r}: {bare!r} cannot run here: {unusable[0].reason}. "
            "Run 'shardscale plugins' to see what is usable."
        )
    for name in middle:
        if name.rpartition(":")[2] not in known_mw:
            raise ValueError(
                f"--backend {spec!r}: no middleware named {name!r}. Installed middleware: "
                f"{', '.join(known_mw) or '(none)'}."
            )
    if bare == "local":
        raise ValueError(
            "--backend local reduces nothing across processes and would let ranks disagree; "
            "use c10d (or leave --backend unset) for the demo"
        )


def _forwarded(args: argparse.Namespace, out: Path) -> list[str]:
    flags = [
        "--steps", str(args.steps), "--precision", args.precision,
        "--out", str(out), "--batch-size", str(args.batch_size),
        "--context", str(args.context), "--lr", repr(args.lr),
        "--max-norm", repr(args.max_norm), "--growth-interval", str(args.growth_interval),
        "--init-scale", repr(args.init_scale), "--seed", str(args.seed),
        "--sample-chars", str(args.sample_chars),
    ]  # fmt: skip
    if args.backend:
        flags += ["--backend", args.backend]
    if args.mesh:
        flags += ["--mesh", args.mesh]
    if args.device:
        flags += ["--device", args.device]
    return flags


def _reader(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _stop(procs: Sequence[subprocess.Popen[Any]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-n:])
    except OSError:
        return "(no log)"


def run_demo(args: argparse.Namespace, *, stream: TextIO | None = None) -> int:
    """Run the demo; returns the exit status (0 when every rank finished)."""
    import torch

    from shardscale.cli._distributed import free_port
    from shardscale.cli._ui import UI_EXTRA_HINT, have_matplotlib, have_rich
    from shardscale.cli.train import config_from_args

    out_stream = stream if stream is not None else sys.stdout
    try:
        world_size = _world_size(args)
        config_from_args(args)  # bad numbers fail here, before any process starts
        _check_backend(args.backend)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if world_size > n_gpu:
            print(f"error: --device cuda with {world_size} processes needs {world_size} GPUs; "
                  f"this machine has {n_gpu}. Pass --world-size {max(1, n_gpu)} or --device cpu.",
                  file=sys.stderr)  # fmt: skip
            return 2
    out: Path = args.out.resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    use_rich = have_rich() and not args.plain and out_stream.isatty()
    if not (have_rich() and have_matplotlib()):
        print(f"note: plain output and no plot because rich/matplotlib are not installed; "
              f"{UI_EXTRA_HINT} to get them", file=out_stream)  # fmt: skip
    base_env = dict(os.environ)
    threads = max(1, (os.cpu_count() or 1) // world_size) if device == "cpu" else 1
    base_env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", OMP_NUM_THREADS=str(threads),
        SHARDSCALE_LAUNCHER="shardscale demo", PYTHONUNBUFFERED="1",
    )  # fmt: skip
    flags = _forwarded(args, out)
    print(f"shardscale demo: {world_size} processes on {device} "
          f"({'NCCL' if device == 'cuda' else 'gloo'}), output in {out}", file=out_stream, flush=True)  # fmt: skip
    procs: list[subprocess.Popen[Any]] = []
    log_files: list[IO[str]] = []
    try:
        for rank in range(world_size):
            env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
            progress = "jsonl" if rank == 0 else "none"
            cmd = [sys.executable, "-m", "shardscale.cli.train", *flags, "--progress", progress]
            log: IO[str] = open(logs / f"rank{rank}.log", "w", encoding="utf-8")  # noqa: SIM115
            log_files.append(log)
            procs.append(subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE if rank == 0 else log, stderr=log,
                text=True, bufsize=1,
            ))  # fmt: skip
        return _follow(procs, log_files[0], logs, args, out_stream, use_rich)
    except KeyboardInterrupt:
        print("interrupted: stopping every rank", file=sys.stderr)
        return 130
    finally:
        _stop(procs)
        for log in log_files:
            log.close()


def _follow(
    procs: list[subprocess.Popen[Any]],
    rank0_log: IO[str],
    logs: Path,
    args: argparse.Namespace,
    out_stream: TextIO,
    use_rich: bool,
) -> int:
    from shardscale.cli._report import METRICS_FILE, render_report
    from shardscale.cli._ui import ProgressView
    from shardscale.cli.train import EVENT_PREFIX

    lines: queue.Queue[str | None] = queue.Queue()
    assert procs[0].stdout is not None
    threading.Thread(target=_reader, args=(procs[0].stdout, lines), daemon=True).start()
    deadline = time.monotonic() + args.timeout
    eof = False
    with ProgressView(args.steps, use_rich=use_rich, stream=out_stream) as view:
        while not (eof and all(p.poll() is not None for p in procs)):
            failed = next(
                ((r, p.returncode) for r, p in enumerate(procs) if p.poll() not in (None, 0)), None
            )
            if failed is not None:
                view.close()
                rank, code = failed
                log = logs / f"rank{rank}.log"
                print(f"error: rank {rank} exited with status {code}; last lines of {log}:\n"
                      f"{_tail(log)}", file=sys.stderr)  # fmt: skip
                return 1
            if time.monotonic() > deadline:
                view.close()
                print(f"error: the demo did not finish in {args.timeout:.0f} s (--timeout); "
                      f"stopping every rank. Logs: {logs}", file=sys.stderr)  # fmt: skip
                return 1
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                eof = True
            elif not line.startswith(EVENT_PREFIX):
                rank0_log.write(line)  # stray prints of rank 0 go to its log
            else:
                event = json.loads(line[len(EVENT_PREFIX) :])
                if event["event"] == "step":
                    view.update(step=event["step"], loss=event["loss"], scale=event["scale"],
                                grad_norm=event["grad_norm"], skipped=event["skipped"],
                                skipped_total=event["skipped_total"])  # fmt: skip
    metrics = args.out.resolve() / METRICS_FILE
    if not metrics.exists():
        print(f"error: training finished without writing {metrics}; see {logs}", file=sys.stderr)
        return 1
    render_report(
        json.loads(metrics.read_text(encoding="utf-8")), metrics.parent, stream=out_stream
    )
    return 0
