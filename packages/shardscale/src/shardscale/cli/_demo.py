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

from shardscale.cli._report import LOGS_DIR
from shardscale.cli._trainer import TrainConfig

__all__ = ["DEFAULT_TIMEOUT_S", "add_demo_parser", "run_demo"]


#: Default ``--timeout``: several times the CPU demo's minute or so, for a loaded machine.
DEFAULT_TIMEOUT_S = 300.0


def add_demo_parser(sub: Any) -> argparse.ArgumentParser:
    """Register the ``demo`` subcommand."""
    from shardscale.cli._cmdline import add_command
    from shardscale.cli.train import add_training_options

    p = add_command(
        sub,
        "demo",
        help="train a small transformer on 2 local processes and plot it",
        description="Train a small decoder-only transformer on Shakespeare's Sonnets, "
        "FSDP2-sharded over local processes, with fp16 autocast, ShardedGradScaler and "
        "unscale_and_clip_. Shows progress, a summary table, and writes a PNG plot. "
        "About a minute on 2 CPU cores; sized bigger when CUDA is present.",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="number of processes (default 2, or the size --mesh asks for)",
    )
    add_training_options(p)
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"stop every rank after this many seconds (default {DEFAULT_TIMEOUT_S:.0f})",
    )
    p.add_argument(
        "--plain", action="store_true", help="plain text output even if rich is installed"
    )
    p.set_defaults(func=run_demo)
    return p


def _world_size(args: argparse.Namespace) -> int:
    from shardscale.cli._distributed import mesh_shape
    from shardscale.cli._options import check_world_size

    if args.world_size is not None:
        return check_world_size(int(args.world_size))  # a mesh mismatch: check_mesh names both
    if args.mesh and args.mesh.strip():
        return mesh_shape(args.mesh).size
    return 2


def _device(args: argparse.Namespace, world_size: int) -> str:
    import torch

    device: str = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if world_size > n_gpu:
            raise ValueError(
                f"--device cuda with {world_size} processes needs {world_size} GPUs; this "
                f"machine has {n_gpu}. Pass --world-size {max(1, n_gpu)} or --device cpu."
            )
    return device


def _forwarded(args: argparse.Namespace, cfg: TrainConfig, out: Path) -> list[str]:
    # The resolved config, not the raw options: every rank runs exactly what was checked.
    flags = [
        "--steps", str(cfg.steps), "--precision", cfg.precision,
        "--out", str(out), "--batch-size", str(cfg.batch_size),
        "--context", str(cfg.context), "--d-model", str(cfg.d_model),
        "--layers", str(cfg.n_layers), "--heads", str(cfg.n_heads), "--lr", repr(cfg.lr),
        "--max-norm", repr(cfg.max_norm), "--growth-interval", str(cfg.growth_interval),
        "--init-scale", repr(cfg.init_scale), "--seed", str(cfg.seed),
        "--sample-chars", str(cfg.sample_chars), "--progress-dir", str(out / LOGS_DIR),
    ]  # fmt: skip
    if cfg.spike:
        flags.append("--spike")
    if cfg.inject_spike:
        flags += ["--inject-spike", str(cfg.inject_spike)]
    if cfg.max_consecutive_skips:
        flags += ["--max-consecutive-skips", str(cfg.max_consecutive_skips)]
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
    """Run the demo; returns the exit status (0 when every rank finished).

    Every option is checked before the output folder is touched or a process
    starts (see [Note: refuse before acting] in ``_options``).
    """
    from shardscale.cli._cmdline import command_error
    from shardscale.cli._distributed import free_port
    from shardscale.cli._options import check_timeout, prepare_out
    from shardscale.cli._ui import UI_EXTRA_HINT, have_matplotlib, have_rich
    from shardscale.cli.train import check_args

    out_stream = stream if stream is not None else sys.stdout
    started = time.monotonic()
    out: Path = args.out.resolve()
    try:
        world_size = _world_size(args)
        device = _device(args, world_size)
        cfg = check_args(args, device=device, world_size=world_size)
        check_timeout(args.timeout)
        prepare_out(out, logs=True)  # the first change on disk, after every check
    except ValueError as exc:
        return command_error(args, str(exc))
    logs = out / LOGS_DIR
    logs.mkdir(exist_ok=True)
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
    flags = _forwarded(args, cfg, out)
    print(f"shardscale demo: {world_size} processes on {device} "
          f"({'NCCL' if device == 'cuda' else 'gloo'}), {cfg.precision}, {cfg.steps} steps, "
          f"output in {out}", file=out_stream, flush=True)  # fmt: skip
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
        status = _follow(procs, log_files[0], logs, args, cfg, out, out_stream, use_rich)
        if status == 0:
            print(f"demo wall time: {time.monotonic() - started:.1f} s (start-up included)",
                  file=out_stream, flush=True)  # fmt: skip
        return status
    except KeyboardInterrupt:
        print("interrupted: stopping every rank", file=sys.stderr)
        return 130
    finally:
        _stop(procs)
        for log in log_files:
            log.close()


def _timeout_hint(args: argparse.Namespace, cfg: TrainConfig) -> str:
    tips = [f"--steps {max(1, cfg.steps // 3)}"]
    if cfg.precision == "fp16":
        tips.append("--precision bf16 (much faster than fp16 on CPU)")
    tips += [f"--context {max(8, cfg.context // 2)}", f"--timeout {args.timeout * 3:.0f}"]
    return "try " + ", ".join(tips)


def _follow(
    procs: list[subprocess.Popen[Any]],
    rank0_log: IO[str],
    logs: Path,
    args: argparse.Namespace,
    cfg: TrainConfig,
    out: Path,
    out_stream: TextIO,
    use_rich: bool,
) -> int:
    from shardscale.cli._rankstatus import describe_every_rank, describe_ranks, read_rank_status
    from shardscale.cli._report import METRICS_FILE, render_report
    from shardscale.cli._ui import ProgressView
    from shardscale.cli.train import EVENT_PREFIX

    lines: queue.Queue[str | None] = queue.Queue()
    assert procs[0].stdout is not None
    threading.Thread(target=_reader, args=(procs[0].stdout, lines), daemon=True).start()
    deadline = time.monotonic() + args.timeout
    eof = False
    with ProgressView(cfg.steps, use_rich=use_rich, stream=out_stream) as view:
        while not (eof and all(p.poll() is not None for p in procs)):
            failed = next(
                ((r, p.returncode) for r, p in enumerate(procs) if p.poll() not in (None, 0)), None
            )
            if failed is not None:
                view.close()
                rank, code = failed
                log = logs / f"rank{rank}.log"
                print(f"shardscale demo: error: rank {rank} exited with status {code}; last lines of {log}:\n"
                      f"{_tail(log)}", file=sys.stderr)  # fmt: skip
                return 1
            statuses = read_rank_status(logs, len(procs))
            if time.monotonic() > deadline:
                view.close()
                print(f"shardscale demo: error: the demo did not finish in {args.timeout:g} s (--timeout) "
                      f"[{describe_every_rank(statuses)}]; stopped every rank (logs: {logs}); "
                      f"{_timeout_hint(args, cfg)}", file=sys.stderr)  # fmt: skip
                return 1
            view.ranks(describe_ranks(statuses))
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
    metrics = out / METRICS_FILE
    if not metrics.exists():
        print(
            f"shardscale demo: error: training finished without writing {metrics}; see {logs}",
            file=sys.stderr,
        )
        return 1
    render_report(json.loads(metrics.read_text(encoding="utf-8")), out, stream=out_stream)
    return 0
