"""Adapter claims, priorities and descriptions in one process (world size 1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from shardscale.core import AdapterContext, LayoutError, PlainTensorAdapter, Registry
from shardscale.fsdp import (
    DTENSOR_PRIORITY,
    FSDP1_PRIORITY,
    DTensorAdapter,
    Fsdp1Adapter,
    fsdp1_layout,
    register_fsdp1,
)

pytestmark = [
    pytest.mark.usefixtures("world1"),
    pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`:UserWarning"),
]

CTX = AdapterContext()


def _registry() -> Registry:
    registry = Registry()
    registry.load()
    return registry


def _dtensor_param(placements: list[object], mesh_shape: tuple[int, ...] = (1,)) -> nn.Parameter:
    names = tuple(f"m{i}" for i in range(len(mesh_shape)))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    return nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, placements))  # type: ignore[arg-type]


def test_installed_adapters_come_through_the_entry_point_highest_priority_first() -> None:
    adapters = _registry().adapters()
    names = [a.name for a in adapters]
    assert names.index("fsdp1") < names.index("dtensor") < names.index("plain")
    assert FSDP1_PRIORITY > DTENSOR_PRIORITY > PlainTensorAdapter.priority


def test_most_specific_adapter_wins() -> None:
    registry = _registry()
    plain = nn.Parameter(torch.randn(3))
    assert registry.adapter_for(plain).name == "plain"
    assert registry.adapter_for(_dtensor_param([Shard(0)])).name == "dtensor"
    flat = FullyShardedDataParallel(nn.Linear(3, 2), device_id=torch.device("cpu"))
    (flat_param,) = list(flat.parameters())
    # A FlatParameter looks like a plain nn.Parameter, but each rank holds a different shard:
    # the plain adapter refuses it (counting one shard as the whole would be silently wrong).
    assert not PlainTensorAdapter().claims(flat_param)
    assert registry.adapter_for(flat_param).name == "fsdp1"


def test_dtensor_adapter_claims_only_dtensors() -> None:
    adapter = DTensorAdapter()
    assert adapter.claims(_dtensor_param([Replicate()]))
    assert not adapter.claims(nn.Parameter(torch.randn(2)))
    assert not adapter.claims(torch.randn(2))


def test_fsdp1_adapter_does_not_claim_dtensors_or_plain_params() -> None:
    adapter = Fsdp1Adapter()
    assert not adapter.claims(_dtensor_param([Shard(0)]))
    assert not adapter.claims(nn.Parameter(torch.randn(2)))


@pytest.mark.parametrize(
    ("mesh_shape", "placements"),
    [
        ((1,), [Shard(0)]),
        ((1,), [Replicate()]),
        ((1, 1), [Replicate(), Shard(0)]),
        ((1, 1), [Shard(0), Shard(1)]),
        ((1, 1), [_StridedShard(0, split_factor=1), Shard(0)]),
    ],
    ids=["fsdp-1d", "tp-replicate", "hsdp-2d", "fsdp-tp-2d", "strided-2d"],
)
def test_dtensor_grads_on_size_one_meshes_count_on_the_only_rank(
    mesh_shape: tuple[int, ...], placements: list[object]
) -> None:
    param = _dtensor_param([Replicate()] * len(mesh_shape), mesh_shape)
    local = torch.randn(4, 3)
    param.grad = DTensor.from_local(local, param.device_mesh, placements, run_check=False)  # type: ignore[arg-type]
    shard = DTensorAdapter().describe(param, param.grad, CTX)
    assert shard.local is param.grad._local_tensor  # scaled in place, so no copy
    assert shard.counts is True
    assert shard.ranks == frozenset({0})


def test_partial_dtensor_grads_are_refused_with_the_fix() -> None:
    param = _dtensor_param([Replicate()])
    grad = DTensor.from_local(torch.ones(4, 3), param.device_mesh, [Partial()])
    with pytest.raises(LayoutError, match=r"Partial.*redistribute"):
        DTensorAdapter().describe(param, grad, CTX)


def test_plain_grad_on_a_dtensor_param_is_refused() -> None:
    param = _dtensor_param([Shard(0)])
    with pytest.raises(LayoutError, match="plain Tensor gradient"):
        DTensorAdapter().describe(param, torch.ones(4, 3), CTX)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_params_are_found_without_registration(use_orig_params: bool) -> None:
    model = FullyShardedDataParallel(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
        device_id=torch.device("cpu"),
        use_orig_params=use_orig_params,
    )
    model(torch.randn(3, 4)).sum().backward()
    adapter = Fsdp1Adapter()
    for param in model.parameters():
        assert adapter.claims(param)
        assert param.grad is not None
        shard = adapter.describe(param, param.grad, CTX)
        assert shard.local is param.grad
        # One rank: FSDP1 switches to NO_SHARD, replicated over a group of one.
        assert shard.counts is True
        assert shard.ranks == frozenset({0})
        layout = fsdp1_layout(param)
        assert layout is not None
        assert layout.strategy == "NO_SHARD"


def test_register_fsdp1_records_every_parameter() -> None:
    inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    inner[0] = FullyShardedDataParallel(
        inner[0], device_id=torch.device("cpu"), use_orig_params=True
    )
    model = FullyShardedDataParallel(inner, device_id=torch.device("cpu"), use_orig_params=True)
    # Nested wrappers: each parameter belongs to exactly one FlatParameter, plus 2 flat params.
    assert register_fsdp1(model) == 4 + 2
    assert all(fsdp1_layout(p) is not None for p in model.parameters())


def test_register_fsdp1_refuses_an_unwrapped_model() -> None:
    with pytest.raises(LayoutError, match="no FullyShardedDataParallel"):
        register_fsdp1(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"nn\.Module"):
        register_fsdp1(object())  # type: ignore[arg-type]


def test_fsdp1_marked_param_without_owner_is_a_clear_error() -> None:
    orphan = nn.Parameter(torch.randn(3))
    orphan._fsdp_flattened = True  # type: ignore[attr-defined]
    adapter = Fsdp1Adapter()
    assert adapter.claims(orphan)
    with pytest.raises(LayoutError, match="register_fsdp1"):
        adapter.describe(orphan, torch.zeros(3), CTX)


def test_fsdp2_params_are_dtensors_for_the_registry() -> None:
    model = nn.Linear(4, 2)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    registry = _registry()
    assert {registry.adapter_for(p).name for p in model.parameters()} == {"dtensor"}


def test_scaler_refuses_partial_grads_before_touching_any_gradient() -> None:
    from shardscale.core import ShardedGradScaler

    plain = nn.Parameter(torch.ones(3))
    param = _dtensor_param([Replicate()])
    plain.grad = torch.full((3,), 8.0)
    param.grad = DTensor.from_local(torch.full((4, 3), 8.0), param.device_mesh, [Partial()])
    opt = torch.optim.SGD([plain, param], lr=1.0)
    scaler = ShardedGradScaler("cpu", backend="local", init_scale=4.0)
    scaler.scale(torch.ones(()))
    with pytest.raises(LayoutError, match="Partial"):
        scaler.unscale_(opt)
    assert torch.equal(plain.grad, torch.full((3,), 8.0))  # not unscaled
    assert torch.equal(param.grad._local_tensor, torch.full((4, 3), 8.0))
    assert scaler.get_scale() == 4.0
