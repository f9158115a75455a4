"""Checks on the demo's and the training script's options, all made before anything starts.

[Note: refuse before acting]
``shardscale demo`` and ``python -m shardscale.cli.train`` check every option
here first: numbers (:func:`~shardscale.cli._trainer.check_config_values`), the
mesh against the world size and the heads, the context against the corpus, the
backend against the registry and the output folder against the file system.
Each failure is one ``ValueError`` line naming the option and a fix; the
callers print it and exit with status 2. Only after every check passes is the
output folder created (:func:`prepare_out`) or a process started, so a refused
command leaves no trace.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from shardscale.cli._distributed import MeshShape, parse_mesh
from shardscale.cli._report import output_files
from shardscale.cli._trainer import TrainConfig

__all__ = [
    "check_backend",
    "check_context",
    "check_mesh",
    "check_out",
    "check_timeout",
    "check_world_size",
    "prepare_out",
]


def check_world_size(world_size: int) -> int:
    """``--world-size`` must be a count of processes."""
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}; try e.g. --world-size 2")
    return world_size


def check_mesh(spec: str | None, world_size: int, cfg: TrainConfig) -> MeshShape:
    """The mesh fits the world size and tensor parallelism splits whole heads."""
    if spec is not None and not spec.strip():
        raise ValueError(
            "--mesh is empty: write e.g. '2' (FSDP), '2x2' (FSDP x tensor parallel) or "
            "'pp2xdp2' (pipeline stages x FSDP), or leave --mesh out for FSDP over every rank"
        )
    shape = parse_mesh(spec, world_size)
    if shape.pp > 1 and cfg.n_layers < shape.pp:
        raise ValueError(
            f"--mesh {spec}: {shape.pp} pipeline stages need at least {shape.pp} transformer "
            f"blocks, but --layers is {cfg.n_layers}; pass --layers {shape.pp} or fewer stages"
        )
    if shape.pp > 1 and cfg.batch_size % shape.pp:
        raise ValueError(
            f"--mesh {spec}: the pipeline splits each batch into {shape.pp} microbatches, but "
            f"--batch-size {cfg.batch_size} does not divide evenly; pass --batch-size "
            f"{shape.pp * max(1, cfg.batch_size // shape.pp)}"
        )
    if cfg.n_heads % shape.tp:
        raise ValueError(
            f"--mesh {spec}: tensor parallelism over {shape.tp} ranks splits the {cfg.n_heads} "
            f"attention heads unevenly; pass --heads {shape.tp * max(1, cfg.n_heads // shape.tp)} "
            f"(and a --d-model divisible by it) or a mesh whose TP size divides {cfg.n_heads}"
        )
    return shape


def check_context(cfg: TrainConfig) -> None:
    """Windows of ``--context`` characters fit in the held-out part of the corpus."""
    from shardscale.cli._corpus import load_corpus

    # The held-out part is the smaller one; every window must fit in it (plus the target).
    longest = int(load_corpus().held_out.numel()) - 2
    if cfg.context > longest:
        raise ValueError(
            f"--context {cfg.context} is longer than the corpus allows (at most {longest} "
            f"characters fit its held-out part); try e.g. --context {min(longest, 128)}"
        )


def check_timeout(timeout: float) -> None:
    """``--timeout`` is a finite number of seconds above zero."""
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(
            f"--timeout must be a finite number of seconds > 0, got {timeout!r}; "
            "try e.g. --timeout 300"
        )


def check_backend(spec: str | None, *, world_size: int) -> None:
    """The backend chain names installed, usable plugins (a no-op for ``None``: automatic)."""
    if spec is None:
        return
    from shardscale.core import get_registry

    if not spec.strip():
        raise ValueError("--backend is empty: leave it out for automatic, or try --backend c10d")
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
    if bare == "local" and world_size > 1:
        raise ValueError(
            "--backend local reduces nothing across processes and would let ranks disagree; "
            "use c10d (or leave --backend unset)"
        )


def _nearest_existing(path: Path) -> Path:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def check_out(out: Path) -> None:
    """``--out`` is (or can become) a folder we may write to; changes nothing on disk."""
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"--out {out} is a file, not a folder; pass a folder, e.g. --out runs/demo"
        )
    base = _nearest_existing(out)
    if not base.is_dir():
        raise ValueError(
            f"--out {out}: {base} is a file, so the folder cannot be created; pass another --out"
        )
    # os.access is only a first answer (root passes it); prepare_out's probe file is the proof.
    if not os.access(base, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {base} is not writable; pass a folder you can write to")


def prepare_out(out: Path, *, logs: bool) -> None:
    """Create ``out`` and remove the files a run writes there, so old and new never mix.

    Only the run's own files go (``metrics.json``, ``training.png``,
    ``result-rank*.json`` and, with ``logs``, ``logs/rank*``); anything else in
    the folder is left alone. Raises ``ValueError`` when the folder cannot be
    written.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".shardscale-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        for stale in output_files(out, logs=logs):
            stale.unlink(missing_ok=True)
    except OSError as exc:
        raise ValueError(
            f"--out {out} cannot be written ({exc.strerror or exc}); pass a folder you can write to"
        ) from exc
