"""The demo's training script; runs under ``torchrun`` unchanged.

One node, two processes::

    torchrun --nproc-per-node 2 -m shardscale.cli.train --steps 200 --out runs/demo

Two nodes (run one command on each; ``HOST0`` is the first node's address)::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 \\
        --rdzv-backend c10d --rdzv-endpoint HOST0:29500 -m shardscale.cli.train
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 \\
        --rdzv-backend c10d --rdzv-endpoint HOST0:29500 -m shardscale.cli.train

Rank 0 shows progress and writes ``metrics.json``, ``steps.jsonl`` (the
scaler's telemetry, one line per step) and ``training.png`` to ``--out``; every rank writes ``result-rank<N>.json`` (final loss and a hash of
the full parameters, identical on every rank of a healthy run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from shardscale.cli._trainer import TrainConfig, size_defaults

__all__ = [
    "EVENT_PREFIX",
    "build_parser",
    "check_args",
    "config_from_args",
    "main",
    "scale_text",
]

#: Lines on rank 0's stdout starting with this carry JSON events for ``shardscale demo``.
EVENT_PREFIX = "@@shardscale-event "
DEFAULT_OUT = "shardscale-demo"


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_parser(prog: str = "python -m shardscale.cli.train") -> argparse.ArgumentParser:
    """Options of the training script (``shardscale demo`` adds --world-size on top)."""
    from shardscale.cli._cmdline import CommandParser

    p = CommandParser(
        prog=prog,
        description="Train a small character-level transformer on Shakespeare's Sonnets with "
        "FSDP2, autocast, ShardedGradScaler and unscale_and_clip_.",
    )
    add_training_options(p)
    p.add_argument(
        "--progress",
        choices=["auto", "rich", "plain", "jsonl", "none"],
        default="auto",
        help="how rank 0 reports each step (jsonl: machine-readable events)",
    )
    p.add_argument(
        "--progress-dir",
        type=Path,
        default=None,
        help="every rank writes its phase and step to rank<N>.progress here "
        "(shardscale demo uses it to show a slow rank)",
    )
    return p


def _sized(field: str) -> str:
    cpu, cuda = size_defaults("cpu")[field], size_defaults("cuda")[field]
    return f"default {cpu} on CPU, {cuda} with CUDA"


def scale_text(value: float) -> str:
    """A loss scale as people write it: ``2**16 = 65536`` for powers of two, else ``%g``."""
    mantissa, exponent = math.frexp(value)
    if value > 0 and mantissa == 0.5 and exponent - 1 >= 4:
        return f"2**{exponent - 1} = {int(value)}"
    return f"{value:g}"


def add_training_options(p: argparse.ArgumentParser) -> None:
    """The options shared by the script and ``shardscale demo``.

    Size options default to ``None``: :func:`config_from_args` fills them in for
    the device (see [Note: the demo's size] in ``_trainer``).
    """
    d = TrainConfig()
    p.add_argument(
        "--steps", type=int, default=None, metavar="N", help=f"optimizer steps ({_sized('steps')})"
    )
    p.add_argument(
        "--precision",
        choices=["fp16", "bf16"],
        default=d.precision,
        help="autocast dtype (default fp16; bf16 is much faster on CPU)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="cuda (NCCL, one GPU per process) when available, else cpu (gloo)",
    )
    p.add_argument(
        "--backend",
        default=None,
        metavar="SPEC",
        help="shardscale collective backend, e.g. c10d or counting+c10d "
        "(default: automatic; see 'shardscale plugins')",
    )
    p.add_argument(
        "--mesh",
        default=None,
        metavar="MESH",
        help="'2x2' (= 'dp2xtp2') = FSDP over 2 ranks x tensor parallel over 2; 'pp2xdp2' = 2 "
        "pipeline stages, each FSDP over 2 ranks; 'pp2' = 2 stages (default: FSDP over all "
        "ranks). The grammar: dims joined by 'x', each [dp|tp|pp]N, outermost first",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path(DEFAULT_OUT),
        metavar="DIR",
        help=f"folder for metrics.json, training.png, result-rank*.json (default ./{DEFAULT_OUT}); "
        "a re-used folder has those files replaced, never mixed",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        metavar="N",
        help=f"sequences per rank per step ({_sized('batch_size')})",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="N",
        help=f"characters per sequence ({_sized('context')})",
    )
    p.add_argument(
        "--d-model", type=int, default=None, metavar="N", help=f"model width ({_sized('d_model')})"
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help=f"transformer blocks ({_sized('n_layers')})",
    )
    p.add_argument(
        "--heads",
        type=int,
        default=None,
        metavar="N",
        help=f"attention heads ({_sized('n_heads')})",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=d.lr,
        metavar="X",
        help=f"peak learning rate, AdamW (default {d.lr:g})",
    )
    p.add_argument(
        "--max-norm",
        type=float,
        default=d.max_norm,
        metavar="X",
        help=f"gradient clipping threshold (default {d.max_norm:g}; inf: never clip)",
    )
    p.add_argument(
        "--growth-interval",
        type=int,
        default=d.growth_interval,
        metavar="N",
        help=f"clean steps before the loss scale doubles (default {d.growth_interval})",
    )
    p.add_argument(
        "--init-scale",
        type=float,
        default=d.init_scale,
        metavar="X",
        help=f"initial loss scale (default {scale_text(d.init_scale)}: high on purpose, the first "
        "fp16 steps overflow and back it off)",
    )
    p.add_argument(
        "--spike",
        action="store_true",
        help="skip steps whose gradient norm spikes (SpikeSkip, 6 sigma over the last 32 "
        "accepted steps); with --precision bf16 the scaler runs without loss scaling",
    )
    p.add_argument(
        "--inject-spike",
        type=int,
        default=d.inject_spike,
        metavar="STEP",
        help="multiply rank 0's loss by 1e3 at STEP (1-based) to show a spike skip (default 0: "
        "never; not with pipeline stages)",
    )
    p.add_argument(
        "--max-consecutive-skips",
        type=int,
        default=d.max_consecutive_skips,
        metavar="N",
        help="stop every rank after N skipped steps in a row (default 0: never)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help=f"seed of the initial weights, the batches and the sample (default {d.seed}); "
        "the same seed and options repeat a run",
    )
    p.add_argument(
        "--sample-chars",
        type=int,
        default=d.sample_chars,
        metavar="N",
        help=f"characters to generate after training (default {d.sample_chars}; 0: none)",
    )


def config_from_args(args: argparse.Namespace, *, device: str = "cpu") -> TrainConfig:
    """A :class:`TrainConfig` from parsed options, sized for ``device``.

    Raises ``ValueError`` with one line naming the option and a fix.
    """
    from shardscale.cli._trainer import check_config_values, default_config

    sized = size_defaults(device)
    given = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "context": args.context,
        "d_model": args.d_model,
        "n_layers": args.layers,
        "n_heads": args.heads,
    }
    values: dict[str, Any] = {k: sized[k] if v is None else v for k, v in given.items()}
    values.update(
        lr=args.lr,
        max_norm=args.max_norm,
        precision=args.precision,
        backend=args.backend,
        init_scale=args.init_scale,
        growth_interval=args.growth_interval,
        seed=args.seed,
        sample_chars=args.sample_chars,
        spike=bool(getattr(args, "spike", False)),
        inject_spike=args.inject_spike,
        max_consecutive_skips=args.max_consecutive_skips,
        warmup=min(20, max(3, values["steps"] // 5)),
    )
    check_config_values(values, cli=True)  # option names in the message, before the dataclass
    return default_config(device, **values)


def _emit(event: dict[str, Any]) -> None:
    from shardscale.cli._report import finite_or_none

    print(EVENT_PREFIX + json.dumps(finite_or_none(event), allow_nan=False), flush=True)


def check_args(args: argparse.Namespace, *, device: str, world_size: int) -> TrainConfig:
    """Every check of [Note: refuse before acting]; one-line ``ValueError`` on the first failure."""
    from shardscale.cli._options import check_backend, check_context, check_mesh, check_out

    cfg = config_from_args(args, device=device)
    shape = check_mesh(args.mesh, world_size, cfg)
    if cfg.inject_spike and shape.pp > 1:
        raise ValueError(
            f"--inject-spike {cfg.inject_spike} scales the loss before backward, which pipeline "
            f"stages (--mesh {args.mesh}) compute inside their schedule; leave --inject-spike out "
            "or use a mesh without pp"
        )
    default = TrainConfig()
    for option, name in (("--init-scale", "init_scale"), ("--growth-interval", "growth_interval")):
        if cfg.precision != "fp16" and getattr(cfg, name) != getattr(default, name):
            raise ValueError(
                f"{option} sets fp16 loss scaling, but --precision {cfg.precision} runs without "
                f"it (loss_scaling=False: the scale stays 1); leave {option} out or use "
                "--precision fp16"
            )
    if cfg.inject_spike > cfg.steps:
        raise ValueError(
            f"--inject-spike {cfg.inject_spike} is past the last step ({cfg.steps}); try e.g. "
            f"--inject-spike {max(1, cfg.steps * 3 // 4)}"
        )
    check_context(cfg)
    check_backend(args.backend, world_size=world_size)
    check_out(args.out)
    return cfg


def _launch_world_size() -> int:
    # What the launcher says; the full environment check is init_distributed's.
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return max(1, int(raw))
    except ValueError:
        raise ValueError(
            f"WORLD_SIZE={raw!r} is not a number; start the script with torchrun"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the training script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    device = args.device or _default_device()
    try:
        cfg = check_args(args, device=device, world_size=_launch_world_size())
        if os.environ.get("RANK", "0") == "0":
            from shardscale.cli._options import prepare_out

            # Rank 0 clears the last run's files before any rank can write new ones: the
            # others write theirs only after training, which needs rank 0.
            prepare_out(args.out, logs=False)
    except ValueError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    # torchrun sets OMP_NUM_THREADS=1 for several processes; keep the cores split when run otherwise.
    if "OMP_NUM_THREADS" not in os.environ and device == "cpu":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))

    import torch.distributed as dist

    from shardscale.cli._distributed import init_distributed
    from shardscale.cli._rankstatus import RankStatusWriter
    from shardscale.cli._report import (
        METRICS_FILE,
        STEPS_FILE,
        render_report,
        result_file,
        scale_changes,
        write_json,
    )
    from shardscale.cli._trainer import StepMetrics, train
    from shardscale.cli._ui import ProgressView, have_rich

    status = RankStatusWriter(
        args.progress_dir, rank=int(os.environ.get("RANK", "0")), steps=cfg.steps
    )
    status.update("joining the process group")
    try:
        ctx = init_distributed(device=device, mesh=args.mesh)
    except (RuntimeError, ValueError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    status.update("building the model")
    out_dir: Path = args.out
    mode = args.progress
    if mode == "auto":
        mode = "rich" if have_rich() and sys.stdout.isatty() else "plain"
    try:
        if ctx.is_main:
            mesh_desc = (
                f"{ctx.shape.pp} pipeline stages x FSDP over {ctx.shape.dp}"
                if ctx.shape.pp > 1
                else f"FSDP {ctx.shape.dp} x TP {ctx.shape.tp}"
                if ctx.shape.tp > 1
                else f"FSDP over {ctx.shape.dp}"
            )
            if mode == "jsonl":
                _emit(
                    {
                        "event": "start",
                        "steps": cfg.steps,
                        "world_size": ctx.world_size,
                        "mesh": mesh_desc,
                        "device": str(ctx.device),
                    }
                )
            elif mode != "none":
                print(
                    f"training on {ctx.world_size} rank(s), {mesh_desc}, {ctx.device}, "
                    f"{cfg.precision} autocast, launched by {ctx.launcher}",
                    flush=True,
                )
        view = ProgressView(cfg.steps, use_rich=mode == "rich")
        active = ctx.is_main and mode in ("rich", "plain")

        def on_step(m: StepMetrics) -> None:
            status.update("training", m.step)
            if not ctx.is_main:
                return
            if mode == "jsonl":
                _emit({"event": "step", **m.to_json()})
            elif active:
                view.update(
                    step=m.step,
                    loss=m.loss,
                    scale=m.scale,
                    grad_norm=m.grad_norm,
                    skipped=m.skipped,
                    skipped_total=m.skipped_total,
                )

        if active:
            with view:
                result = train(cfg, ctx, on_step=on_step, steps_file=out_dir / STEPS_FILE)
        else:
            result = train(cfg, ctx, on_step=on_step, steps_file=out_dir / STEPS_FILE)
        status.update("writing results", cfg.steps)
        write_json(
            result_file(out_dir, ctx.rank),
            {
                "rank": result.rank,
                "world_size": result.world_size,
                "mesh": result.mesh,
                "steps": result.steps,
                "skipped_steps": result.skipped_steps,
                "first_loss": result.first_loss,
                "final_loss": result.final_loss,
                "held_out_loss": result.held_out_loss,
                "params_sha256": result.params_sha256,
                "launcher": ctx.launcher,
            },
        )
        if ctx.is_main:
            doc = {
                "config": asdict(cfg),
                "run": {
                    "world_size": ctx.world_size,
                    "mesh": result.mesh,
                    "mesh_desc": mesh_desc,
                    "device": result.device,
                    "precision": result.precision,
                    "backend": result.backend,
                    "parameters": result.parameters,
                    "launcher": ctx.launcher,
                    "corpus": "Shakespeare, Sonnets (1609), char-level",
                    "tokens_per_step": cfg.batch_size * cfg.context * ctx.shape.dp,
                },
                "summary": {
                    "first_loss": result.first_loss,
                    "final_loss": result.final_loss,
                    "held_out_loss": result.held_out_loss,
                    "skipped_steps": result.skipped_steps,
                    "skip_reasons": result.skip_reasons,
                    "scale_backoffs": scale_changes(
                        [m.scale for m in result.history] + [result.final_scale]
                    )[0],
                    "final_scale": result.final_scale,
                    "wall_s": result.wall_s,
                    "params_sha256": result.params_sha256,
                    "sample": result.sample,
                    "first_overflow": result.first_overflow,
                },
                "history": [m.to_json() for m in result.history],
            }
            path = write_json(out_dir / METRICS_FILE, doc)
            if mode == "jsonl":
                _emit({"event": "done", "metrics": str(path.resolve())})
            elif mode != "none":
                render_report(doc, out_dir, stream=sys.stdout)
        status.update("done", cfg.steps)
    finally:
        # Sessions from SHARDSCALE_TELEMETRY write what they still hold (no collective).
        from shardscale.telemetry import close_all

        close_all()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
