"""ShardedGradScaler on FSDP2 and FSDP1 models in one process, against unsharded references."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FullyShardedDataParallel,
    MixedPrecisionPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from shardscale.core import ShardedGradScaler

pytestmark = [
    pytest.mark.usefixtures("world1"),
    pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`:UserWarning"),
    pytest.mark.filterwarnings("ignore:When using ``NO_SHARD``:UserWarning"),
]

STEPS = 6
INF_STEPS = (2, 3)
SCALER_ARGS = {"init_scale": 2.0**8, "growth_interval": 2}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _inject_inf(model: nn.Module) -> None:
    grad = next(p.grad for p in model.parameters() if p.grad is not None)
    local = _local(grad)
    if local.numel():
        local.view(-1)[-1] = float("inf")


def _train(
    model: nn.Module,
    make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    scaler: ShardedGradScaler | torch.amp.GradScaler,
    *,
    explicit_unscale: bool = False,
) -> tuple[list[float], list[float]]:
    opt = make_opt(list(model.parameters()))
    gen = torch.Generator().manual_seed(1)
    losses, scales = [], []
    for step in range(STEPS):
        x = torch.randn(5, 8, generator=gen)
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        if step in INF_STEPS:
            _inject_inf(model)
        if explicit_unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        scales.append(scaler.get_scale())
    return losses, scales


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _fused_adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01, fused=True)


def _assert_same_params(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(_full(p.detach()), q.detach(), msg=name)


def _fsdp2(model: nn.Module, **kwargs: object) -> nn.Module:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    for layer in (model[0], model[2]):  # type: ignore[index]
        fully_shard(layer, mesh=mesh, **kwargs)  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh, **kwargs)  # type: ignore[arg-type]
    return model


@pytest.mark.parametrize(
    ("make_opt", "explicit_unscale"),
    [(_sgd, False), (_sgd, True), (_fused_adam, False), (_fused_adam, True)],
    ids=["sgd", "sgd-unscale", "fused-adam", "fused-adam-unscale"],
)
def test_fsdp2_matches_an_unsharded_reference(
    make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer], explicit_unscale: bool
) -> None:
    reference = _model()
    model = _fsdp2(copy.deepcopy(reference))
    ref_losses, ref_scales = _train(
        reference,
        make_opt,
        torch.amp.GradScaler("cpu", **SCALER_ARGS),
        explicit_unscale=explicit_unscale,
    )
    losses, scales = _train(
        model,
        make_opt,
        ShardedGradScaler("cpu", backend="local", **SCALER_ARGS),
        explicit_unscale=explicit_unscale,
    )
    assert scales == ref_scales
    assert scales[INF_STEPS[0]] < scales[INF_STEPS[0] - 1]  # the injected inf really backed off
    torch.testing.assert_close(losses, ref_losses)
    _assert_same_params(model, reference)


@pytest.mark.parametrize(
    "policy",
    [
        {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
        {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)},
        {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
    ],
    ids=["bf16-params", "fp16-reduce", "cpu-offload"],
)
def test_fsdp2_policies_match_torch_grad_scaler_on_the_same_model(
    policy: dict[str, object],
) -> None:
    # Same FSDP2 model, same policy: in one process torch's scaler is the reference.
    ours = _fsdp2(_model(), **policy)
    theirs = _fsdp2(_model(), **policy)
    ref_losses, ref_scales = _train(theirs, _sgd, torch.amp.GradScaler("cpu", **SCALER_ARGS))
    losses, scales = _train(ours, _sgd, ShardedGradScaler("cpu", backend="local", **SCALER_ARGS))
    assert scales == ref_scales
    assert losses == ref_losses
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(_full(p.detach()), _full(q.detach()))


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_matches_an_unsharded_reference(use_orig_params: bool) -> None:
    reference = _model()
    model = FullyShardedDataParallel(
        copy.deepcopy(reference), device_id=torch.device("cpu"), use_orig_params=use_orig_params
    )
    ref_losses, ref_scales = _train(reference, _sgd, torch.amp.GradScaler("cpu", **SCALER_ARGS))
    losses, scales = _train(model, _sgd, ShardedGradScaler("cpu", backend="local", **SCALER_ARGS))
    assert scales == ref_scales
    torch.testing.assert_close(losses, ref_losses)
    full = model.state_dict()  # FSDP1's default: full, unflattened, original names
    expected = reference.state_dict()
    assert full.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(full[name], value, msg=name)
