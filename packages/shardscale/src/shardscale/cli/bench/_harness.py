"""One (mesh, optimizer) configuration on one rank: interleaved timed steps, then the counts.

[Note: what is timed]
Every round runs each arm once, in the balanced order of ``_order``. A step
is timed as forward + backward (hooks of streaming statistics included, they
run inside backward) plus post-processing (unscale, clip, step, update); a
barrier between the two, so that all ranks start post-processing together,
is not timed. Each rank records its own times; the slowest rank's time is
kept per round and arm. After the timed rounds, untimed steps count
collectives (torch's ``CommDebugMode`` for every arm, the ``counting``
middleware for ours), gradient bytes (``_bytes``), and launches and host
syncs of post-processing (``_launches``; syncs on CUDA only).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from shardscale.cli.bench._arms import Arm, make_arms
from shardscale.cli.bench._bytes import GradBytesCounter, local_tensor
from shardscale.cli.bench._config import AMP_DTYPES, BenchConfig, mesh_shape
from shardscale.cli.bench._launches import count_launches, host_sync
from shardscale.cli.bench._order import balanced_order, rounds_for
from shardscale.cli.bench._progress import ProgressFile
from shardscale.cli.bench._workload import Net

__all__ = ["COUNTING_MAX_NORM", "rounds_per_config", "run_config"]

#: max_norm of the step in which bytes are counted: far below any gradient norm, so the
#: clipping coefficient is < 1 and every write changes bits (see [Note: counting gradient bytes]).
COUNTING_MAX_NORM = 1e-6


def _local_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]


def _state_tensors(arm: Arm) -> list[torch.Tensor]:
    """Parameters and the optimizer state of their size (Adam's moments), as local tensors."""
    out = []
    for param in arm.model.parameters():
        local = local_tensor(param)
        out.append(local)
        for value in arm.opt.state.get(param, {}).values():
            if isinstance(value, torch.Tensor) and local_tensor(value).numel() == local.numel():
                out.append(local_tensor(value))
    return out


def _launches_and_syncs(
    arm: Arm, loss_of: Any, max_norm: float, device: torch.device
) -> dict[str, Any]:
    """Launches of one post-processing step and where it syncs the host (see ``_launches``).

    The arm's last use: run after every other count.
    """

    def backward() -> None:
        arm.opt.zero_grad(set_to_none=True)
        arm.scaler.scale(loss_of(arm)).backward()

    backward()
    out: dict[str, Any] = {
        "launches_post": count_launches(lambda: arm.post(max_norm), device),
        "launches_counted_as": "CUDA kernels"
        if device.type == "cuda"
        else "top-level aten ops (CPU: no launches)",
    }
    if device.type != "cuda":
        out["host_sync_post"] = out["host_sync_clip"] = "n/a"  # nothing to sync with
        return out
    backward()
    # Unscale + clip alone: an unfused optimizer's step syncs by design (torch's too).
    out["host_sync_clip"] = host_sync(lambda: arm.clip(max_norm), device)
    if out["host_sync_clip"] is not None:  # it stopped mid-clip: the arm cannot step on
        out["host_sync_post"] = "not run (unscale + clip synced)"
        return out
    arm.scaler.step(arm.opt)
    arm.scaler.update()
    backward()
    # Last: a sync raises inside step(), which leaves this arm mid-iteration (its last use).
    out["host_sync_post"] = host_sync(lambda: arm.post(max_norm), device)
    return out


def _count_collectives(arm: Arm, max_norm: float) -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode

    out: dict[str, Any] = {}
    records = None
    if arm.ours:
        from shardscale.collectives import CountingMiddleware, find_middleware

        counting = find_middleware(arm.scaler.backend, CountingMiddleware)
        counting.reset()
        records = counting.records
    with CommDebugMode() as comm:  # type: ignore[no-untyped-call]
        arm.post(max_norm)
    out["collectives_comm_debug_mode"] = int(comm.get_total_counts())
    out["collectives_counting_middleware"] = None if records is None else len(records)
    out["collectives"] = len(records) if records is not None else out["collectives_comm_debug_mode"]
    out["collectives_counted_with"] = "counting middleware" if arm.ours else "CommDebugMode"
    return out


def _count_bytes(arm: Arm, loss_of: Any) -> dict[str, Any]:
    """Bytes of gradient memory touched by post-processing + step (and by backward hooks)."""
    arm.opt.zero_grad(set_to_none=True)
    hooks = GradBytesCounter(active=False)
    handles = []
    if arm.stream is not None:
        # Bracket the streaming hooks with ours: enter before them, leave after them.
        def enter(param: torch.Tensor) -> None:
            if param.grad is not None:
                hooks.add([param.grad])
            hooks.active = True

        def leave(param: torch.Tensor) -> None:
            hooks.active = False

        params = list(arm.model.parameters())
        handles += [p.register_post_accumulate_grad_hook(enter) for p in params]  # type: ignore[no-untyped-call]
        arm.restream()
        handles += [p.register_post_accumulate_grad_hook(leave) for p in params]  # type: ignore[no-untyped-call]
    with hooks:
        arm.scaler.scale(loss_of(arm)).backward()
    for handle in handles:
        handle.remove()
    with GradBytesCounter(_local_grads(arm.model)) as post:
        post.add_state(_state_tensors(arm))
        arm.post(COUNTING_MAX_NORM)
    return {
        "grad_bytes_read": post.read,
        "grad_bytes_written": post.written,
        "state_bytes_read": post.state_read,
        "state_bytes_written": post.state_written,
        "grad_bytes_read_in_backward_hooks": hooks.read,
        "grad_bytes_by_op": {
            op: [post.by_op.get(op, 0), post.by_op_written.get(op, 0)]
            for op in sorted(set(post.by_op) | set(post.by_op_written))
        },
    }


def rounds_per_config(cfg: BenchConfig) -> int:
    """Rounds (warm-up and measured) of one mesh and optimizer, plus one unit for the counts."""
    return cfg.warmup + rounds_for(cfg.steps, len(cfg.arms())) + 1


def run_config(
    cfg: BenchConfig,
    mesh_kind: str,
    opt_name: str,
    *,
    progress: ProgressFile | None = None,
    done_before: int = 0,
    total: int = 0,
) -> dict[str, Any]:
    """Time every arm on one mesh and optimizer; the result is the same on every rank.

    ``progress`` hears of every round (as ``done_before`` + rounds done, of ``total``), between
    rounds: never inside a timed part.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    shape = mesh_shape(mesh_kind, world)
    device = cfg.torch_device()
    torch.manual_seed(0)
    base = Net(width=cfg.width, hidden=cfg.hidden, blocks=cfg.blocks).to(device)
    names = cfg.arms()
    arms, dp_rank = make_arms(names, base, shape, opt_name, device=cfg.device, backend=cfg.backend)
    del base

    def batch(step: int) -> torch.Tensor:
        # The same data for every arm in a round; each dp rank its own.
        gen = torch.Generator().manual_seed(1000 * step + dp_rank)
        return torch.randn(cfg.batch, cfg.width, generator=gen).to(device)

    def sync() -> None:
        if cfg.device == "cuda":
            torch.cuda.synchronize()

    amp = AMP_DTYPES[cfg.amp]

    def loss_for(step: int) -> Any:
        def loss(arm: Arm) -> torch.Tensor:
            if amp is None:
                out: torch.Tensor = arm.model(batch(step))
            else:
                with torch.autocast(device.type, dtype=getattr(torch, amp)):
                    out = arm.model(batch(step))
            return out.float().pow(2).mean()

        return loss

    # Warm-up needs no balance; any run of whole cycles after it is balanced (the design is cyclic).
    warm = cfg.warmup
    measured = rounds_for(cfg.steps, len(arms))
    order = balanced_order(len(arms), warm + measured)
    # [arm, round, (forward+backward, post, whole step)] in seconds, this rank.
    times = torch.zeros(len(arms), measured, 3, dtype=torch.float64)
    label = f"{mesh_kind} {opt_name}"
    for rnd, row in enumerate(order):
        if progress is not None:
            what = "warm-up" if rnd < warm else f"round {rnd - warm + 1}/{measured}"
            progress.event("rows", label=f"{label}: {what}", done=done_before + rnd, total=total)
        for index in row:
            arm = arms[index]
            dist.barrier()
            sync()
            start = time.perf_counter()
            arm.opt.zero_grad(set_to_none=True)
            arm.scaler.scale(loss_for(rnd)(arm)).backward()
            sync()
            backward_end = time.perf_counter()
            dist.barrier()  # ranks start post-processing together; not timed
            post_start = time.perf_counter()
            arm.post(cfg.max_norm)
            sync()
            end = time.perf_counter()
            if rnd >= warm:
                fb, post = backward_end - start, end - post_start
                times[index, rnd - warm] = torch.tensor([fb, post, fb + post], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    out: dict[str, Any] = {
        "mesh": mesh_kind,
        "mesh_shape": list(shape),
        "mesh_dims": ["dp"] if len(shape) == 1 else ["dp", "tp"],
        "optimizer": opt_name,
        "warmup_rounds": warm,
        "rounds": measured,
        "order_first_rounds": [
            [names[i] for i in row] for row in order[warm : warm + 2 * len(arms)]
        ],
        "counts_from_rank": dist.get_rank(),
        "arms": {},
    }
    step_after = warm + measured
    if progress is not None:
        progress.event("rows", label=f"{label}: counting collectives, bytes, launches",
                       done=done_before + len(order), total=total)  # fmt: skip
    for i, arm in enumerate(arms):
        rec: dict[str, Any] = {
            "backward_ms": (times[i, :, 0] * 1e3).tolist(),
            "post_ms": (times[i, :, 1] * 1e3).tolist(),
            "step_ms": (times[i, :, 2] * 1e3).tolist(),
        }
        arm.opt.zero_grad(set_to_none=True)
        arm.scaler.scale(loss_for(step_after)(arm)).backward()
        rec.update(_count_collectives(arm, cfg.max_norm))
        rec.update(_count_bytes(arm, loss_for(step_after + 1)))
        rec.update(_launches_and_syncs(arm, loss_for(step_after + 2), cfg.max_norm, device))
        out["arms"][arm.name] = rec
    out["local_grad_bytes"] = sum(g.numel() * g.element_size() for g in _local_grads(arms[0].model))
    if progress is not None:
        progress.event(
            "rows", label=f"{label}: done", done=done_before + len(order) + 1, total=total
        )
    return out
