"""FSDP2 (``fully_shard``) + fp16 autocast + ``ShardedGradScaler`` + ``unscale_and_clip_``.

Run it with ``torchrun --nproc-per-node 2 examples/fsdp2_fp16.py``: gloo on CPU, NCCL with
one GPU per rank when CUDA is there.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from shardscale.clip import unscale_and_clip_
from shardscale.core import ShardedGradScaler, SkipReason

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
torch.manual_seed(0)  # the same initial model on every rank; FSDP2 then keeps one shard each
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
for module in (model[0], model[2], model.to(device)):  # each layer, then the root
    fully_shard(module)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
# torch.amp.GradScaler's arguments. The scale starts high on purpose: the first steps overflow
# fp16, are skipped on every rank, and back it off.
scaler = ShardedGradScaler(device.type, init_scale=2.0**24)
x = torch.randn(128, 32, generator=torch.Generator().manual_seed(rank)).to(device)  # own batch
y = x[:, :4].sum(-1, keepdim=True)
for step in range(30):
    with torch.autocast(device.type, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    norm = unscale_and_clip_(scaler, optimizer, max_norm=1.0)  # global norm, one collective
    scaler.step(optimizer)  # skipped on every rank if any rank's gradients overflowed
    scaler.update()
    optimizer.zero_grad()
    if rank == 0:  # these reads sync with the device: a real loop would log less often
        reason = SkipReason(int(scaler.last_skip_reason)).name.lower()
        print(f"step {step:2d}  loss {loss.item():.4f}  norm {norm.item():.4f}  "
              f"next scale {scaler.get_scale():.0f}  skipped: {reason}")  # fmt: skip
full = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
every = [torch.empty_like(full) for _ in range(world)]
dist.all_gather(every, full)
if rank == 0:
    print(f"{world} ranks, same parameters: {all(torch.equal(p, full) for p in every)}")
dist.destroy_process_group()
