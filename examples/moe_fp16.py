"""fp16 loss scaling and clipping for a mixture-of-experts model with expert parallelism.

Run on 4 CPU processes (it starts them itself):
    python examples/moe_fp16.py                  # torchtitan's layout (DTensor experts)
    python examples/moe_fp16.py --style plain    # each rank's experts as ordinary parameters
or under torchrun: torchrun --nproc-per-node 4 examples/moe_fp16.py [--style plain]

``dtensor`` (torchtitan's layout): dense layers FSDP2-sharded over all 4 ranks;
the 4 experts' stacked weights sharded over an ``ep`` mesh dim (2 experts per
rank) and FSDP2-sharded over the other dim (``efsdp``). Nothing to declare:
the meshes say who holds what.

``plain``: each rank holds one expert as ordinary parameters and the dense
layers replicated (their gradients summed across ranks, as DDP does). The
experts are declared with ``distinct_params=`` -- each rank passes its own.

Either way: the norm counts every expert once and every dense parameter once,
in ONE collective; at step 3 one expert rank overflows and every rank skips.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STEPS, POISON_STEP, ROWS, DIM, HIDDEN, EXPERTS = 6, 3, 32, 16, 24, 4


class Experts(nn.Module):
    """``EXPERTS`` two-layer MLPs as two stacked weights (torchtitan's GroupedExperts)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.3)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.3)

    def forward(self, h: torch.Tensor, expert: torch.Tensor, first: int) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        w1, w2 = self.w1, self.w2
        if isinstance(w1, DTensor):  # FSDP2 gathered the efsdp shards; these are our experts
            w1, w2 = w1.to_local(), w2.to_local()  # type: ignore[union-attr]
        out = torch.zeros_like(h)
        for e in range(w1.shape[0]):  # an expert without rows still runs: same graph everywhere
            rows = torch.nonzero(expert == first + e).flatten()
            y = torch.tanh(h[rows] @ w1[e].to(h.dtype)) @ w2[e].to(h.dtype)
            out = out.index_add(0, rows, y.to(out.dtype))
        return out


class MoE(nn.Module):
    """Dense input layer, a top-1 router, ``EXPERTS`` MLPs as two stacked weights, a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(DIM, DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, ep_group: Any) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        probs = torch.softmax(self.router(h).float(), dim=-1)
        top = probs.argmax(dim=-1)
        order = torch.argsort(top, stable=True)
        routed = self.dispatch(h[order], top[order], ep_group)
        mixed = torch.zeros_like(routed).index_add(0, order, routed)
        return self.head(h + mixed * probs.gather(1, top[:, None]).to(mixed.dtype))

    def dispatch(self, h: torch.Tensor, expert: torch.Tensor, group: Any) -> torch.Tensor:
        """Send each row to the rank holding its expert (all-to-all), run it, send it back."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        ep, me = dist.get_world_size(group), dist.get_rank(group)
        per = EXPERTS // ep
        send = torch.bincount(expert // per, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        s, r = send.tolist(), recv.tolist()
        got = all_to_all_single_autograd(h, r, s, group)
        got_expert = torch.empty(sum(r), dtype=expert.dtype)
        dist.all_to_all_single(got_expert, expert, r, s, group=group)
        out = self.experts(got, got_expert, me * per)
        return all_to_all_single_autograd(out, s, r, group)


def _sum_reduce(module: nn.Module) -> None:
    # Every rank's loss is a share of the global mean: FSDP2 sums (gloo has no PREMUL_SUM).
    for m in module.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def train(style: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardscale.clip import unscale_and_clip_
    from shardscale.core import Layout, ShardedGradScaler

    world, rank = dist.get_world_size(), dist.get_rank()
    model = MoE()
    dense = [model.inp, model.router, model.head]
    if style == "dtensor":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("efsdp", "ep"))
        for name in ("w1", "w2"):
            full = getattr(model.experts, name).detach()
            setattr(
                model.experts, name, nn.Parameter(distribute_tensor(full, mesh["ep"], [Shard(0)]))
            )
        fully_shard(model.experts, mesh=mesh["efsdp"], shard_placement_fn=lambda p: Shard(1))
        dense_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for layer in dense:
            fully_shard(layer, mesh=dense_mesh)
        _sum_reduce(model)
        ep_group = mesh["ep"].get_group()
        scaler = ShardedGradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    else:
        for name in ("w1", "w2"):  # keep only this rank's expert, as an ordinary parameter
            full = getattr(model.experts, name).detach()
            setattr(model.experts, name, nn.Parameter(full[rank : rank + 1].clone()))
        ep_group = dist.group.WORLD
        experts = [model.experts.w1, model.experts.w2]
        # The one declaration: these plain parameters are this rank's own, not replicas.
        scaler = ShardedGradScaler(
            "cpu", init_scale=2.0**12, growth_interval=2, layout=Layout(distinct_params=experts)
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for step in range(STEPS):
        x, y = torch.randn(ROWS, DIM, generator=gen), torch.randn(ROWS, 1, generator=gen)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x, ep_group)
        loss = (out.float() - y).pow(2).sum() / ROWS  # this rank's share of the global mean
        scaler.scale(loss).backward()
        if style == "plain":
            for layer in dense:  # the dense layers are replicated: sum their shares (DDP's job)
                for p in layer.parameters():
                    dist.all_reduce(p.grad)  # type: ignore[arg-type]
        if step == POISON_STEP and rank == 2:  # one expert rank overflows
            grad = model.experts.w1.grad
            local = grad._local_tensor if hasattr(grad, "_local_tensor") else grad  # type: ignore[union-attr]
            local.view(-1)[0] = math.inf  # type: ignore[union-attr]
        norm = unscale_and_clip_(scaler, optimizer, max_norm=1.0)  # ONE collective
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        rows.append((float(norm), scaler.get_scale(), bool(scaler.last_step_skipped)))
    everyone: list[object] = [None] * world
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        for step, (norm, scale, skipped) in enumerate(rows):
            print(f"step {step}: norm {norm:.4f}  scale {scale:g}  skipped {skipped}")
        agree = all(r == rows for r in everyone)
        print(f"[{style}] every rank: same norms, scales and skips:", agree)
        if not agree or not rows[POISON_STEP][2]:
            raise SystemExit(1)


def _worker(rank: int, world: int, port: int, style: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train(style)
        # Every rank done communicating before any tears gloo down: a peer closing its
        # connections while rank 0 still prints can abort rank 0's gloo threads (SIGABRT).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--style", choices=["dtensor", "plain"], default="dtensor")
    style = parser.parse_args().style
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        train(style)
        dist.barrier()
        dist.destroy_process_group()
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.set_num_threads(1)
    mp.spawn(_worker, args=(4, port, style), nprocs=4)


if __name__ == "__main__":
    main()
