"""Process-group setup for the demo's training script, the way ``torchrun`` expects it.

[Note: one script for every launcher]
The training script reads only the standard environment variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) that ``torchrun`` sets, whether one node or
many. ``shardscale demo`` starts its processes with exactly those variables,
so the same code runs under both. Started by hand with none of them, the
script becomes a one-process group on a free local port.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "LAUNCH_ENV",
    "DistContext",
    "MeshShape",
    "free_port",
    "init_distributed",
    "mesh_shape",
    "parse_mesh",
    "shard_model",
]

#: The variables a launcher must set (torchrun does); checked together so a half-set environment fails clearly.
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, slots=True)
class MeshShape:
    """Data-parallel (FSDP) size times tensor-parallel size, times pipeline stages."""

    dp: int
    tp: int = 1
    pp: int = 1

    @property
    def size(self) -> int:
        """Number of ranks the mesh needs."""
        return self.pp * self.dp * self.tp

    def __str__(self) -> str:
        """The mesh in ``--mesh`` syntax: ``pp2xdp2``, ``2x2`` or ``4``."""
        if self.pp > 1:
            return f"pp{self.pp}" + (f"xdp{self.dp}" if self.dp > 1 else "")
        return f"{self.dp}x{self.tp}" if self.tp > 1 else str(self.dp)


@dataclass(frozen=True, slots=True)
class DistContext:
    """Where this process sits in the run."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    shape: MeshShape
    launcher: str

    @property
    def dp_rank(self) -> int:
        """Coordinate on the data-parallel dimension: ranks with equal ``dp_rank`` see the same data."""
        return int(self.mesh["dp"].get_local_rank())

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (0 without pipeline parallelism)."""
        return int(self.mesh["pp"].get_local_rank()) if self.shape.pp > 1 else 0

    @property
    def is_main(self) -> bool:
        """Whether this is global rank 0 (the one that reports)."""
        return self.rank == 0


def mesh_shape(spec: str) -> MeshShape:
    """Parse ``"2x2"`` (FSDP 2 x TP 2), ``"4"`` (FSDP 4) or ``"pp2xdp2"`` (2 stages x FSDP 2).

    The grammar is :mod:`shardscale.cli._mesh_spec`'s; the demo lays out ``dp``,
    ``dp x tp`` and ``pp x dp`` (stages outermost). Not checked against a world
    size (see :func:`parse_mesh`). Raises ``ValueError`` naming the problem.
    """
    from shardscale.cli._mesh_spec import parse_mesh_spec

    mesh = parse_mesh_spec(spec, option="--mesh")
    if mesh.names not in (("dp",), ("dp", "tp"), ("pp",), ("pp", "dp")):
        raise ValueError(
            f"--mesh {spec!r} ({mesh}): the demo runs FSDP ('dp4'), FSDP x tensor parallel "
            "('dp2xtp2', or '2x2') or pipeline stages x FSDP, stages outermost ('pp2' or "
            "'pp2xdp2'); write one of those"
        )
    return MeshShape(dp=mesh.get("dp"), tp=mesh.get("tp"), pp=mesh.get("pp"))


def parse_mesh(spec: str | None, world_size: int) -> MeshShape:
    """``None`` -> ``world_size`` ranks of FSDP; ``"2x2"`` -> FSDP 2 x TP 2; ``"4"`` -> FSDP 4."""
    if spec is None or not spec.strip():
        return MeshShape(world_size)
    shape = mesh_shape(spec)
    if shape.size != world_size:
        raise ValueError(
            f"--mesh {spec} needs {shape.size} processes but the world size is {world_size}; "
            f"pass --world-size {shape.size} (or under torchrun, --nproc-per-node x --nnodes = "
            f"{shape.size})"
        )
    return shape


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for a local rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _launcher_name() -> str:
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    if os.environ.get("SHARDSCALE_LAUNCHER"):
        return os.environ["SHARDSCALE_LAUNCHER"]
    return "environment"


def init_distributed(*, device: str, mesh: str | None, timeout_s: float = 300.0) -> DistContext:
    """Join (or create) the default process group and build the device mesh.

    The mesh is ``("dp", "tp")``, or ``("pp", "dp")`` with pipeline stages.

    ``device`` is ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per local rank).
    """
    present = [name for name in LAUNCH_ENV if name in os.environ]
    launcher = _launcher_name()
    if not present:
        # Started by hand: a group of one, so the same code path runs.
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
        launcher = "standalone"
    elif len(present) != len(LAUNCH_ENV):
        missing = sorted(set(LAUNCH_ENV) - set(present))
        raise RuntimeError(
            f"the environment sets {', '.join(present)} but not {', '.join(missing)}: start the "
            "script with torchrun (which sets them all) or unset them to run one process"
        )
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    shape = parse_mesh(mesh, world_size)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "--device cuda was asked for but CUDA is not available; use --device cpu"
            )
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
                "start at most that many processes per node"
            )
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        pg_backend = "nccl"
    elif device == "cpu":
        dev = torch.device("cpu")
        pg_backend = "gloo"
    else:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if not dist.is_initialized():
        dist.init_process_group(
            backend=pg_backend,
            timeout=timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
        )
    if shape.pp > 1:
        # Pipeline stages outermost: a stage's FSDP group is a row of consecutive ranks.
        device_mesh = init_device_mesh(dev.type, (shape.pp, shape.dp), mesh_dim_names=("pp", "dp"))
    else:
        device_mesh = init_device_mesh(dev.type, (shape.dp, shape.tp), mesh_dim_names=("dp", "tp"))
    return DistContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=dev,
        mesh=device_mesh,
        shape=shape,
        launcher=launcher,
    )


def shard_model(model: nn.Module, ctx: DistContext) -> nn.Module:
    """Tensor-parallelise each block over ``tp`` (if > 1), then FSDP2-shard over ``dp``.

    Embeddings, norms and the output head stay whole under TP (they are small)
    and are sharded by FSDP like everything else.
    """
    from torch.distributed.fsdp import fully_shard

    from shardscale.cli._model import TinyGPT

    if not isinstance(model, TinyGPT):
        raise TypeError(f"shard_model expects the demo's TinyGPT, got {type(model).__name__}")
    if ctx.shape.tp > 1:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        if model.cfg.n_heads % ctx.shape.tp:
            raise ValueError(
                f"tensor parallelism over {ctx.shape.tp} ranks needs n_heads ({model.cfg.n_heads}) "
                "divisible by it"
            )
        plan = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(),
        }
        for block in model.blocks:
            parallelize_module(block, ctx.mesh["tp"], plan)  # type: ignore[arg-type]
    dp_mesh = ctx.mesh["dp"]
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model
