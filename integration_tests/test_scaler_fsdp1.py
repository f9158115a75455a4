"""ShardedGradScaler with FSDP1 ``FullyShardedDataParallel``: every sharding strategy, flat and original params.

Each case wraps every Linear and the root (so there are several flat
parameters, unevenly split: with ``use_orig_params=True`` some original
parameters have no elements, hence no gradient, on some ranks), trains it
against an unsharded reference with an inf injected on one rank only, and
checks scales, losses, parameters, the adapters' counting (Σ|g|²) and one
scaler collective per step. The adapter finds FSDP1's groups by itself; one
case registers the model explicitly with ``shardscale.fsdp.register_fsdp1``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool
from scaler_support import (
    INF_STEP,
    SCALER_ARGS,
    assert_matches_reference,
    global_batches,
    inf_rank,
    inject_inf,
    mlp,
    run_against_reference,
)
from torch import nn

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

ROWS = 8


def _wrap(model: nn.Module, strategy: str, use_orig_params: bool, **kwargs: Any) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    options: dict[str, Any] = {
        "sharding_strategy": ShardingStrategy[strategy],
        "use_orig_params": use_orig_params,
        "device_id": torch.device("cpu"),
        **kwargs,
    }
    if "HYBRID" in strategy:
        ws = dist.get_world_size()
        options["device_mesh"] = init_device_mesh(
            "cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard")
        )
    for index, layer in enumerate(model):  # type: ignore[arg-type]
        if isinstance(layer, nn.Linear):
            model[index] = FSDP(layer, **options)  # type: ignore[index]
    return FSDP(model, **options)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    # FSDP1's default state dict: full, unflattened, original names, on every rank.
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _case_strategy(strategy: str, use_orig_params: bool, register: bool) -> Any:
    from shardscale.fsdp import fsdp1_layout, register_fsdp1

    reference = mlp(hidden=7, out=3)  # odd sizes: uneven shards, some empty
    model = _wrap(copy.deepcopy(reference), strategy, use_orig_params)
    if register:
        register_fsdp1(model)
    ws = dist.get_world_size()
    summary = run_against_reference(
        model,
        reference,
        shard_of=lambda b: b.chunk(ws)[dist.get_rank()],
        rows=ROWS,
        unscale=True,
        full=_full,
    )
    layouts = {fsdp1_layout(p).strategy for p in model.parameters()}  # type: ignore[union-attr]
    counting = [fsdp1_layout(p).counts for p in model.parameters()]  # type: ignore[union-attr]
    return summary, layouts, counting


def _case_fused_adam(unscale: bool, scaler_kind: str) -> Any:
    reference = mlp(hidden=7, out=3)
    model = _wrap(copy.deepcopy(reference), "FULL_SHARD", False)
    ws = dist.get_world_size()

    def make_opt(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=0.01, fused=True)

    if scaler_kind == "torch":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler("cpu", **SCALER_ARGS)
        opt = make_opt(model.parameters())
        scales = []
        for step, batch in enumerate(global_batches(ROWS)):
            x = batch.chunk(ws)[dist.get_rank()]
            scaler.scale(model(x).pow(2).mean()).backward()
            if step == INF_STEP and dist.get_rank() == inf_rank():
                inject_inf(model.parameters())
            try:
                if unscale:
                    scaler.unscale_(opt)
                scaler.step(opt)
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        return scales
    return run_against_reference(
        model,
        reference,
        shard_of=lambda b: b.chunk(ws)[dist.get_rank()],
        rows=ROWS,
        make_opt=make_opt,
        unscale=unscale,
        full=_full,
    )


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_fsdp1_strategies_match_reference(
    pool2: Pool, strategy: str, use_orig_params: bool
) -> None:
    results = pool2.run(_case_strategy, strategy, use_orig_params, False)
    assert_matches_reference([summary for summary, _, _ in results])
    for rank, (_, layouts, counting) in enumerate(results):
        assert layouts == {strategy}
        # Sharded: every rank's shard counts; NO_SHARD: only rank 0's replica.
        assert set(counting) == {strategy != "NO_SHARD" or rank == 0}


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
def test_fsdp1_hybrid_matches_reference(pool4: Pool, strategy: str, use_orig_params: bool) -> None:
    results = pool4.run(_case_strategy, strategy, use_orig_params, False)
    assert_matches_reference([summary for summary, _, _ in results])
    # (replicate, shard) = (2, 2): ranks 0 and 1 hold the counting replica of each shard.
    assert [set(counting) for _, _, counting in results] == [{True}, {True}, {False}, {False}]


def test_fsdp1_explicit_registration(pool2: Pool) -> None:
    results = pool2.run(_case_strategy, "FULL_SHARD", True, True)
    assert_matches_reference([summary for summary, _, _ in results])


@pytest.mark.parametrize("unscale", [False, True], ids=["step-only", "unscale-then-step"])
def test_fsdp1_fused_adam_matches_reference(pool2: Pool, unscale: bool) -> None:
    assert_matches_reference(pool2.run(_case_fused_adam, unscale, "ours"))


def test_torch_fsdp1_scaler_on_fused_adam_without_unscale_diverges(pool2: Pool) -> None:
    """torch 2.13's FSDP1 ShardedGradScaler skips the found_inf all-reduce on this path."""
    scales = pool2.run(_case_fused_adam, False, "torch")
    if torch.__version__.startswith("2.13"):
        assert scales[0] != scales[1], scales
        assert scales[1][INF_STEP] < scales[0][INF_STEP], scales  # only the inf rank backed off


def test_torch_fsdp1_scaler_on_fused_adam_with_unscale_fails(pool2: Pool) -> None:
    errors = pool2.run(_case_fused_adam, True, "torch")
    if torch.__version__.startswith("2.13"):
        # found_inf of shape [1] meets the fused optimizer's 0-dim one.
        assert all(isinstance(e, str) and "shape" in e for e in errors), errors
