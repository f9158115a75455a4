"""fp16 loss scaling and clipping with a real pipeline: 2 stages x 2 FSDP2 replicas, 1F1B.

Run on 4 CPU processes (it starts them itself):   python examples/pipeline_fp16.py
or under torchrun (4 processes):                   torchrun --nproc-per-node 4 examples/pipeline_fp16.py

Only the last stage computes the loss, so only it calls ``scaler.scale``;
the first stage's gradients arrive already scaled through the pipeline. Every
rank still unscales by the same scale, clips by the norm of the WHOLE model
(both stages, each FSDP shard once) in one collective, and skips together
when any rank overflows. At step 3 one rank of the first stage -- a stage
that never scaled anything -- gets an inf gradient: every rank skips it.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch import nn

STEPS, POISON_STEP, ROWS, DIM = 6, 3, 32, 16


def loss_share(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # This microbatch's share of the global mean: shares sum to the mean over the global batch.
    return (out.float() - target).pow(2).sum() / ROWS


def build_stage(stage: int, dp_mesh: object) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same full model on every rank; each keeps its own stage
    layers = [nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1)]
    module = nn.Sequential(*(layers[:2] if stage == 0 else layers[2:]))
    for layer in module:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=dp_mesh)
    fully_shard(module, mesh=dp_mesh)
    for m in module.modules():  # gloo has no PREMUL_SUM: average as a plain sum of shares
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return module


def train() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from shardscale.clip import unscale_and_clip_
    from shardscale.core import Layout, ShardedGradScaler

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    module = build_stage(stage, mesh["dp"])
    # distinct_dims=("pp",): the pp coordinates hold different parameters, never replicas.
    scaler = ShardedGradScaler(
        "cpu", init_scale=2.0**12, growth_interval=2, layout=Layout(distinct_dims=("pp",))
    )
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return scaler.scale(loss_share(out, target))  # the loss is scaled where it is computed

    pipe = PipelineStage(module, stage, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(pipe, n_microbatches=4, loss_fn=loss_fn, scale_grads=False)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for step in range(STEPS):
        x, y = torch.randn(ROWS, DIM, generator=gen), torch.randn(ROWS, 1, generator=gen)
        x, y = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
        with torch.autocast("cpu", dtype=torch.float16):
            if stage == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=[])
        if step == POISON_STEP and dist.get_rank() == 1:  # stage 0: it never called scale()
            next(iter(module.parameters())).grad._local_tensor.view(-1)[0] = math.inf  # type: ignore[union-attr]
        norm = unscale_and_clip_(scaler, optimizer, max_norm=1.0)  # ONE collective, all 4 ranks
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        rows.append((float(norm), scaler.get_scale(), bool(scaler.last_step_skipped)))
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if dist.get_rank() == 0:
        for step, (norm, scale, skipped) in enumerate(rows):
            print(f"step {step}: norm {norm:.4f}  scale {scale:g}  skipped {skipped}")
        agree = all(r == rows for r in everyone)
        print("every stage and replica: same norms, scales and skips:", agree)
        if not agree or not rows[POISON_STEP][2]:
            raise SystemExit(1)


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train()
        # Every rank done communicating before any tears gloo down: a peer closing its
        # connections while rank 0 still prints can abort rank 0's gloo threads (SIGABRT).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        train()
        dist.barrier()
        dist.destroy_process_group()
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.set_num_threads(1)
    mp.spawn(_worker, args=(4, port), nprocs=4)


if __name__ == "__main__":
    main()
