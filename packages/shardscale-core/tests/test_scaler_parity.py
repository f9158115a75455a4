"""ShardedGradScaler against torch's own scalers, run side by side in one process.

Every case trains two identical models on identical data, one with torch's
scaler and one with ours, injecting inf/nan at chosen steps, and requires the
same scale after every update and bit-identical parameters at the end.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchFSDPScaler

from shardscale.core import ShardedGradScaler

POISON_STEPS = {3: math.inf, 6: math.nan, 7: -math.inf}


@pytest.fixture(scope="module", autouse=True)
def _world_of_one() -> Iterator[None]:
    """FSDP1's torch scaler needs a process group even alone: one gloo rank, once per module."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def make_model(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 6)).to(
        dtype
    )


def batches(n: int, dtype: torch.dtype, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 12, generator=gen).to(dtype) for _ in range(n)]


def train(
    scaler: Any,
    model: torch.nn.Module,
    opts: list[torch.optim.Optimizer],
    data: list[torch.Tensor],
    *,
    explicit_unscale: bool = False,
    poison: dict[int, float] | None = None,
) -> list[float]:
    scales = []
    poison = POISON_STEPS if poison is None else poison
    for step, x in enumerate(data):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss = model(x).float().pow(2).mean()
        if step in poison:
            loss = loss * poison[step]
        scaler.scale(loss).backward()
        for opt in opts:
            if explicit_unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), f"parameter {name} differs: max diff {(pa - pb).abs().max()}"


SCALER_KW = {
    "init_scale": 2.0**12,
    "growth_interval": 2,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
}

OptFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, OptFactory] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-3),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-3, fused=True),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, eps=1e-3, foreach=True),
}


def scaler_kw(dtype: torch.dtype) -> dict[str, float]:
    # fp16 activations overflow at large scales on every step; start lower so the scale also grows.
    return {**SCALER_KW, "init_scale": 64.0} if dtype is torch.float16 else SCALER_KW


def reference_scaler(dtype: torch.dtype) -> Any:
    # torch.amp.GradScaler refuses fp16 gradients; FSDP1's ShardedGradScaler is torch's fp16-capable one.
    if dtype is torch.float16:
        return TorchFSDPScaler("cpu", process_group=dist.group.WORLD, **scaler_kw(dtype))
    return torch.amp.GradScaler("cpu", **scaler_kw(dtype))


def _parity_cases() -> list[Any]:
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for opt_name in OPTIMIZERS:
            for explicit in (False, True):
                # torch's FSDP1 scaler crashes on fp16 + fused + unscale_ (found_inf shape (1,)
                # vs ()); that path has its own test below.
                if dtype is torch.float16 and opt_name == "adam_fused" and explicit:
                    continue
                cases.append(
                    pytest.param(
                        dtype,
                        opt_name,
                        explicit,
                        id=f"{dtype}-{opt_name}-{'unscale_' if explicit else 'auto'}",
                    )
                )
    return cases


@pytest.mark.parametrize(("dtype", "opt_name", "explicit_unscale"), _parity_cases())
def test_parity_with_torch(dtype: torch.dtype, opt_name: str, explicit_unscale: bool) -> None:
    data = batches(10, dtype)
    ref_model, our_model = make_model(dtype), make_model(dtype)
    ref_opt = OPTIMIZERS[opt_name](list(ref_model.parameters()))
    our_opt = OPTIMIZERS[opt_name](list(our_model.parameters()))
    ref_scales = train(
        reference_scaler(dtype), ref_model, [ref_opt], data, explicit_unscale=explicit_unscale
    )
    ours = ShardedGradScaler("cpu", backend="local", **scaler_kw(dtype))
    our_scales = train(ours, our_model, [our_opt], data, explicit_unscale=explicit_unscale)
    assert our_scales == ref_scales
    assert_same_params(ref_model, our_model)
    # The poisoned steps really were skipped and the scale really moved both ways.
    init = scaler_kw(dtype)["init_scale"]
    assert min(our_scales) < init < max(our_scales)


def test_fp16_fused_adam_after_unscale_matches_amp_semantics() -> None:
    """Where torch's FSDP1 scaler crashes, ours matches torch.amp's semantics on fp32 master math."""
    data = batches(8, torch.float16)
    model = make_model(torch.float16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    scaler = ShardedGradScaler("cpu", backend="local", **SCALER_KW)
    train(scaler, model, [opt], data, explicit_unscale=True)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # Torch's own scaler fails on exactly this path.
    torch_model = make_model(torch.float16)
    torch_opt = torch.optim.Adam(torch_model.parameters(), lr=1e-2, fused=True)
    with pytest.raises(RuntimeError):
        train(
            TorchFSDPScaler("cpu", **SCALER_KW),
            torch_model,
            [torch_opt],
            data,
            explicit_unscale=True,
        )


def test_several_optimizers_share_one_scaler() -> None:
    data = batches(10, torch.float32)
    models = [make_model(torch.float32), make_model(torch.float32)]
    scales = []
    for model, scaler in zip(
        models,
        [
            torch.amp.GradScaler("cpu", **SCALER_KW),
            ShardedGradScaler("cpu", backend="local", **SCALER_KW),
        ],
        strict=True,
    ):
        layers = list(model.children())
        opts: list[torch.optim.Optimizer] = [
            torch.optim.SGD(layers[0].parameters(), lr=0.05),
            torch.optim.Adam(layers[2].parameters(), lr=1e-2),
        ]
        scales.append(train(scaler, model, opts, data, explicit_unscale=True))
    assert scales[0] == scales[1]
    assert_same_params(models[0], models[1])


def test_overflow_in_one_of_two_optimizers_skips_only_that_one() -> None:
    runs = []
    for scaler in (
        torch.amp.GradScaler("cpu", **SCALER_KW),
        ShardedGradScaler("cpu", backend="local", **SCALER_KW),
    ):
        a, b = make_model(torch.float32), make_model(torch.float32, seed=5)
        opt_a, opt_b = (
            torch.optim.SGD(a.parameters(), lr=0.1),
            torch.optim.SGD(b.parameters(), lr=0.1),
        )
        scales = []
        for step, x in enumerate(batches(6, torch.float32)):
            opt_a.zero_grad()
            opt_b.zero_grad()
            loss_a, loss_b = a(x).pow(2).mean(), b(x).pow(2).mean()
            if step == 2:
                loss_b = loss_b * math.inf
            scaler.scale(loss_a + loss_b).backward()
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append((scales, a, b))
    assert runs[0][0] == runs[1][0]
    assert_same_params(runs[0][1], runs[1][1])
    assert_same_params(runs[0][2], runs[1][2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_sparse_gradients(dtype: torch.dtype) -> None:
    results = []
    for scaler in (
        torch.amp.GradScaler("cpu", **SCALER_KW),
        ShardedGradScaler("cpu", backend="local", **SCALER_KW),
    ):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(20, 4, sparse=True).to(dtype)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        scales = []
        gen = torch.Generator().manual_seed(3)
        for step in range(8):
            opt.zero_grad()
            idx = torch.randint(0, 20, (6,), generator=gen)
            loss = emb(idx).pow(2).sum()
            if step == 4:
                loss = loss * math.inf
            scaler.scale(loss).backward()
            assert emb.weight.grad is not None and emb.weight.grad.is_sparse
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        results.append((scales, emb.weight.detach().clone()))
    assert results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1])


def test_fp16_sparse_gradients_are_coalesced_like_torch() -> None:
    grads = []
    for scaler in (
        TorchFSDPScaler("cpu", **SCALER_KW),
        ShardedGradScaler("cpu", backend="local", **SCALER_KW),
    ):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True).half()
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        idx = torch.tensor([1, 1, 2, 1])  # duplicates: uncoalesced until the scaler coalesces
        scaler.scale(emb(idx).float().sum()).backward()
        scaler.unscale_(opt)
        assert emb.weight.grad is not None
        grads.append(emb.weight.grad.to_dense())
        assert emb.weight.grad.is_coalesced()
    assert torch.equal(grads[0], grads[1])


def test_disabled_scaler_is_transparent() -> None:
    data = batches(5, torch.float32)
    runs = []
    for scaler in (
        torch.amp.GradScaler("cpu", enabled=False),
        ShardedGradScaler("cpu", enabled=False),
    ):
        model = make_model(torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scales = train(scaler, model, [opt], data, poison={})
        assert not scaler.is_enabled()
        assert scaler.state_dict() == {}
        runs.append((scales, model))
    assert runs[0][0] == runs[1][0] == [1.0] * 5
    assert_same_params(runs[0][1], runs[1][1])


def test_scale_handles_nested_outputs_like_torch() -> None:
    ours = ShardedGradScaler("cpu", backend="local", init_scale=8.0)
    ref = torch.amp.GradScaler("cpu", init_scale=8.0)
    outputs = [torch.ones(2), (torch.full((3,), 2.0), [torch.tensor(3.0)])]
    got, want = ours.scale(outputs), ref.scale(outputs)
    assert type(got) is type(want) is list
    flat_got = [got[0], got[1][0], got[1][1][0]]
    flat_want = [want[0], want[1][0], want[1][1][0]]
    for g, w in zip(flat_got, flat_want, strict=True):
        assert torch.equal(g, w)
    assert next(iter(ours.scale(iter([torch.ones(1)])))).item() == 8.0


def test_cuda_device_without_cuda_disables_like_torch() -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        ours = ShardedGradScaler()
    with pytest.warns(UserWarning):
        ref = torch.amp.GradScaler()
    assert ours.is_enabled() is ref.is_enabled() is False


def test_getters_setters_and_state_dict_round_trip_with_torch() -> None:
    ours = ShardedGradScaler("cpu", backend="local", init_scale=256.0, growth_interval=7)
    ref = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=7)
    for s in (ours, ref):
        s.set_growth_factor(3.0)
        s.set_backoff_factor(0.25)
        s.set_growth_interval(5)
    assert ours.get_growth_factor() == ref.get_growth_factor() == 3.0
    assert ours.get_backoff_factor() == ref.get_backoff_factor() == 0.25
    assert ours.get_growth_interval() == ref.get_growth_interval() == 5
    assert ours.state_dict() == ref.state_dict()
    # train a few steps on ours, then move the state into a torch scaler and back
    model = make_model(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train(ours, model, [opt], batches(4, torch.float32), poison={2: math.inf})
    sd = ours.state_dict()
    assert set(sd) == set(ref.state_dict())
    fresh_ref = torch.amp.GradScaler("cpu")
    fresh_ref.load_state_dict(copy.deepcopy(sd))
    assert fresh_ref.state_dict() == sd
    back = ShardedGradScaler("cpu", backend="local")
    back.load_state_dict(fresh_ref.state_dict())
    assert back.state_dict() == sd
