"""What one benchmark run does (:class:`BenchConfig`) and the checks made before anything starts."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "AMP_DTYPES",
    "ARMS",
    "MESH_KINDS",
    "OPTIMIZERS",
    "BenchConfig",
    "BenchOptionError",
    "check_config",
    "mesh_shape",
    "quick",
]

#: The arms, in the order the JSON lists them. ``torch_aa`` is a second copy of torch's recipe:
#: its ratio to ``torch`` is the noise floor of the run (the A/A line).
ARMS = ("torch", "torch_aa", "ours", "ours_fuse_optimizer", "ours_streaming", "ours_foreach")
OPTIMIZERS = ("sgd", "adam_fused")
MESH_KINDS = ("1d", "2d")
#: ``--amp`` values and the autocast dtype each names (None: no autocast).
AMP_DTYPES = {"none": None, "fp16": "float16", "bf16": "bfloat16"}


class BenchOptionError(ValueError):
    """A benchmark option is out of range; the message is one line naming the option."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """Every knob of one run. The defaults finish ``nox -s bench`` in about ten minutes on 2 cores."""

    world_size: int = 2
    steps: int = 32  # measured rounds per arm (rounded up to a whole balanced cycle)
    warmup: int = 4
    width: int = 512
    hidden: int = 2048
    blocks: int = 4
    batch: int = 8
    meshes: tuple[str, ...] = MESH_KINDS
    optimizers: tuple[str, ...] = OPTIMIZERS
    max_norm: float = 1.0
    streaming: bool = True
    # ours with fuse_optimizer=True beside ours with the default (the smoke run leaves it out: an
    # odd arm count's balanced cycle is 10 rounds, enough for verdicts a smoke run must not make)
    fuse_optimizer_arm: bool = True
    backend: str = "counting+c10d"
    device: str = "cpu"
    #: Forward under ``torch.autocast`` in this dtype (``fp16``: the fp16 recipe the scaler is
    #: for; ``none``: fp32 throughout, the CPU default). Parameters and gradients stay fp32.
    amp: str = "none"
    threads_per_rank: int = 0  # 0: the CPU count divided by the world size
    seed: int = 0  # bootstrap RNG seed
    resamples: int = 2000  # bootstrap resamples
    rows: bool = True  # False: only the scaling table
    scaling_points: tuple[int, ...] = (250, 500, 1000, 2000, 4000)
    scaling_param_numel: int = 8  # elements per parameter of the scaling model ("tiny")
    repeats: int = 10  # warm repeats per arm and point of the scaling table
    cold_repeats: int = 3  # first calls on a fresh layout per arm and point (at least 3)
    scaling_budget_s: float = 300.0  # time for the whole scaling table; points that would not
    # fit are skipped and reported as such

    def n_params(self) -> int:
        """Parameters of the benchmark model."""
        return self.blocks * (2 * self.width * self.hidden + self.width + self.hidden)

    def torch_device(self) -> torch.device:
        """This rank's device: its current GPU on ``cuda`` (set when the worker starts), else the CPU."""
        import torch

        if self.device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def arms(self) -> tuple[str, ...]:
        """The arms this run measures."""
        return tuple(
            a
            for a in ARMS
            if (self.streaming or a != "ours_streaming")
            and (self.fuse_optimizer_arm or a != "ours_fuse_optimizer")
            # On CUDA the device's kernels (Triton where installed) and foreach side by side.
            and (self.device == "cuda" or a != "ours_foreach")
        )


def quick(cfg: BenchConfig) -> BenchConfig:
    """A smoke-test version of ``cfg``: tiny model, few steps, a two-point scaling table."""
    return replace(
        cfg,
        steps=4,
        warmup=1,
        fuse_optimizer_arm=False,
        width=32,
        hidden=64,
        blocks=1,
        batch=2,
        resamples=200,
        scaling_points=(8, 16),
        repeats=3,
        cold_repeats=3,
        scaling_budget_s=60.0,
    )


def mesh_shape(kind: str, world_size: int) -> tuple[int, ...]:
    """The mesh for ``kind``: ``1d`` is (world,), ``2d`` is (world/2, 2) = dp x tp, otherwise a
    mesh in the grammar of ``shardscale.cli._mesh_spec`` (``dp4``, ``dp2xtp2``, bare ``N`` or
    ``AxB``) with dp and, inside it, tp.

    Raises :class:`BenchOptionError` when the shape does not cover ``world_size`` ranks.
    """
    from shardscale.cli._mesh_spec import MeshSpecError, parse_mesh_spec

    if kind == "1d":
        return (world_size,)
    if kind == "2d":
        if world_size % 2:
            raise BenchOptionError(
                f"--meshes 2d needs an even --world-size (dp x tp=2), got {world_size}"
            )
        return (world_size // 2, 2)
    try:
        spec = parse_mesh_spec(kind, option="--meshes")
    except MeshSpecError as exc:
        raise BenchOptionError(str(exc)) from None
    if spec.names not in (("dp",), ("dp", "tp")):
        raise BenchOptionError(
            f"--meshes {kind!r}: the benchmark shards with FSDP over dp and, inside it, tensor "
            f"parallelism over tp; use dpN or dpAxtpB (e.g. dp{world_size})"
        )
    if spec.size != world_size:
        raise BenchOptionError(
            f"--meshes {kind!r} has {spec.size} ranks but --world-size is {world_size}"
        )
    return spec.sizes


def _positive(name: str, value: float, *, zero_ok: bool = False) -> None:
    ok = math.isfinite(value) and (value >= 0 if zero_ok else value > 0)
    if not ok:
        bound = ">= 0" if zero_ok else "> 0"
        raise BenchOptionError(f"{name} must be a finite number {bound}, got {value!r}")


def check_config(cfg: BenchConfig) -> None:
    """Raise :class:`BenchOptionError` (one line) for any option that cannot run.

    Checks everything that can be checked without starting a process: ranges,
    names (meshes, optimizers, the collective backend spec) and mesh shapes.
    """
    for name, value in (
        ("--world-size", cfg.world_size),
        ("--steps", cfg.steps),
        ("--width", cfg.width),
        ("--hidden", cfg.hidden),
        ("--blocks", cfg.blocks),
        ("--batch", cfg.batch),
        ("--resamples", cfg.resamples),
        ("--repeats", cfg.repeats),
        ("--scaling-param-numel", cfg.scaling_param_numel),
    ):
        _positive(name, value)
    for name, value in (
        ("--warmup", cfg.warmup),
        ("--threads-per-rank", cfg.threads_per_rank),
        ("--seed", cfg.seed),
    ):
        _positive(name, value, zero_ok=True)
    _positive("--max-norm", cfg.max_norm)
    _positive("--scaling-budget", cfg.scaling_budget_s)
    if cfg.cold_repeats < 3:
        raise BenchOptionError(
            f"--cold-repeats must be >= 3 (min/median/max), got {cfg.cold_repeats}"
        )
    if not cfg.meshes:
        raise BenchOptionError("--meshes is empty: give meshes such as dp2,dp1xtp2")
    if not cfg.optimizers:
        raise BenchOptionError("--optimizers is empty: choose from " + ", ".join(OPTIMIZERS))
    if not cfg.rows and not cfg.scaling_points:
        raise BenchOptionError("nothing to run: --scaling-only with --scaling-points none")
    for mesh in cfg.meshes:
        mesh_shape(mesh, cfg.world_size)
    for opt in cfg.optimizers:
        if opt not in OPTIMIZERS:
            raise BenchOptionError(
                f"unknown optimizer {opt!r}: choose from {', '.join(OPTIMIZERS)}"
            )
    for point in cfg.scaling_points:
        if point < 1:
            raise BenchOptionError(f"--scaling-points must be >= 1, got {point}")
    if cfg.amp not in AMP_DTYPES:
        raise BenchOptionError(f"--amp must be one of {', '.join(AMP_DTYPES)}, got {cfg.amp!r}")
    if cfg.device not in ("cpu", "cuda"):
        raise BenchOptionError(f"--device must be cpu or cuda, got {cfg.device!r}")
    _check_backend(cfg.backend)
    _check_plugins()


def _check_backend(spec: str) -> None:
    from shardscale.core import ShardscaleError, get_registry

    try:
        get_registry().make_backend(spec)
    except (ShardscaleError, KeyError, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BenchOptionError(f"--backend {spec!r}: {first}") from None


def _check_plugins() -> None:
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
    if importlib.util.find_spec("shardscale.clip") is None:
        missing.append("shardscale-clip")
    if missing:
        raise BenchOptionError(
            f"the benchmark needs {', '.join(missing)} (pip install shardscale installs them)"
        )
