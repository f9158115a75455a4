"""ShardedGradScaler with DDP, ``replicate`` (DDP- and FSDP2-based) and tensor parallel alone.

Same protocol as the FSDP tests: an unsharded reference trained on the same
data with torch.amp.GradScaler, an inf injected on one rank only, and exactly
one scaler collective per step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool
from scaler_support import assert_matches_reference, mlp, run_against_reference
from torch import nn

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

ROWS = 8


def _make_opt(name: str) -> Any:
    return {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        "fused-adam": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    }[name]


def _case_ddp(optimizer: str, unscale: bool) -> Any:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ws = dist.get_world_size()
    reference = mlp()
    model = DDP(copy.deepcopy(reference))
    return run_against_reference(
        model,
        reference,
        shard_of=lambda b: b.chunk(ws)[dist.get_rank()],
        rows=ROWS,
        make_opt=_make_opt(optimizer),
        unscale=unscale,
    )


def _case_replicate(kind: str) -> Any:
    ws = dist.get_world_size()
    reference = mlp()
    model = copy.deepcopy(reference)
    if kind == "ddp-based":
        from torch.distributed._composable.replicate import replicate

        replicate(model)
    else:
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.device_mesh import init_device_mesh

        replicate(model, mesh=init_device_mesh("cpu", (ws,), mesh_dim_names=("replicate",)))
    param_types = {type(p).__name__ for p in model.parameters()}
    summary = run_against_reference(
        model,
        reference,
        shard_of=lambda b: b.chunk(ws)[dist.get_rank()],
        rows=ROWS,
        unscale=True,
    )
    return summary, param_types


def _case_tp(unscale: bool) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    reference = mlp()
    model = copy.deepcopy(reference)
    parallelize_module(
        model,
        mesh,
        {
            "0": ColwiseParallel(),
            "2": RowwiseParallel(),
            "4": ColwiseParallel(use_local_output=False),
        },
    )

    def loss_of(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        out = m(x)
        # The last layer's output stays sharded on its features: gather for the loss.
        return (out.full_tensor() if isinstance(out, DTensor) else out).pow(2).mean()

    placements = {n: str(p.placements) for n, p in model.named_parameters()}  # type: ignore[attr-defined]
    summary = run_against_reference(
        model,
        reference,
        shard_of=lambda b: b,  # TP ranks all see the whole batch
        rows=ROWS,
        loss_of=loss_of,
        unscale=unscale,
    )
    return summary, placements


@pytest.mark.parametrize("unscale", [False, True], ids=["step-only", "unscale-then-step"])
@pytest.mark.parametrize("optimizer", ["sgd", "fused-adam"])
def test_ddp_matches_reference(pool2: Pool, optimizer: str, unscale: bool) -> None:
    assert_matches_reference(pool2.run(_case_ddp, optimizer, unscale))


@pytest.mark.parametrize("kind", ["ddp-based", "fsdp2-based"])
def test_replicate_matches_reference(pool2: Pool, kind: str) -> None:
    results = pool2.run(_case_replicate, kind)
    assert_matches_reference([summary for summary, _ in results])
    expected = {"ddp-based": {"Parameter"}, "fsdp2-based": {"DTensor"}}[kind]
    assert all(types == expected for _, types in results)


@pytest.mark.parametrize("unscale", [False, True], ids=["step-only", "unscale-then-step"])
def test_tensor_parallel_alone_matches_reference(pool2: Pool, unscale: bool) -> None:
    results = pool2.run(_case_tp, unscale)
    assert_matches_reference([summary for summary, _ in results])
    # The rowwise bias is replicated over tp: the Σ|g|² check above proves it counted once.
    assert results[0][1]["2.bias"] == "(Replicate(),)"


def test_tensor_parallel_on_four_ranks(pool4: Pool) -> None:
    results = pool4.run(_case_tp, True)
    assert_matches_reference([summary for summary, _ in results])
