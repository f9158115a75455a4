"""The step engine in one process: its public API, and the surface code written for torch uses.

Multi-rank promises (errors on every rank, replicas, refusals, localisation)
are in integration_tests/test_step_engine.py; here: the engine called
directly, torch's de-facto private surface (``_per_optimizer_states``,
``found_inf_per_device``, ``_unscale_grads_``, ``grad_scaler=`` optimizers)
compared with torch's own scaler in the same process, and the skip signal.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch.amp.grad_scaler import OptState as TorchOptState

from shardscale.core import GradientDeviceError, ShardedGradScaler, get_registry, hookimpl
from shardscale.core.scaler import OptState
from shardscale.core.step import Apply, StepConfig, StepRequest, run_step


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _backward(model: torch.nn.Module, scaler: Any, poison: float = 1.0) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    scaler.scale(model(x).pow(2).mean() * poison).backward()


def _config() -> StepConfig:
    registry = get_registry()
    return StepConfig(backend=registry.make_backend("local"), registry=registry)


def test_our_opt_state_is_torchs() -> None:
    assert OptState is TorchOptState


@pytest.mark.parametrize("poison", [1.0, math.inf])
def test_per_optimizer_state_has_torchs_shape_and_the_reduced_flags(poison: float) -> None:
    ours, theirs = _model(), _model()
    ours_opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    theirs_opt = torch.optim.SGD(theirs.parameters(), lr=0.1)
    ours_scaler = ShardedGradScaler("cpu", backend="local")
    theirs_scaler = torch.amp.GradScaler("cpu")
    for model, scaler, opt in ((ours, ours_scaler, ours_opt), (theirs, theirs_scaler, theirs_opt)):
        _backward(model, scaler, poison)
        assert scaler._per_optimizer_states[id(opt)]["stage"] is TorchOptState.READY
        scaler.unscale_(opt)
    mine = ours_scaler._per_optimizer_states[id(ours_opt)]
    ref = theirs_scaler._per_optimizer_states[id(theirs_opt)]
    assert set(mine) == set(ref) == {"stage", "found_inf_per_device"}
    assert mine["stage"] is ref["stage"] is TorchOptState.UNSCALED
    flags = mine["found_inf_per_device"]
    assert isinstance(flags, dict) and len(flags) == 1
    (flag,) = flags.values()
    assert (
        float(flag)
        == (0.0 if poison == 1.0 else 1.0)
        == float(sum(v for v in ref["found_inf_per_device"].values()))
    )
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert (
            torch.equal(
                a.grad,
                b.grad,
            )
            if poison == 1.0
            else torch.equal(  # type: ignore[arg-type]
                a.grad.isnan(),
                b.grad.isnan(),  # type: ignore[union-attr]
            )
        )


def test_private_unscale_grads_matches_torch_bit_for_bit() -> None:
    ours, theirs = _model(), _model()
    ours_opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    theirs_opt = torch.optim.SGD(theirs.parameters(), lr=0.1)
    ours_scaler = ShardedGradScaler("cpu", backend="local", init_scale=256.0)
    theirs_scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    _backward(ours, ours_scaler)
    _backward(theirs, theirs_scaler)
    inv = torch.tensor(1 / 256.0)
    got = ours_scaler._unscale_grads_(ours_opt, inv, torch.zeros(()), True)
    want = theirs_scaler._unscale_grads_(theirs_opt, inv, torch.zeros(()), True)
    assert list(got) == list(want) == [torch.device("cpu")]
    assert float(next(iter(got.values()))) == float(next(iter(want.values()))) == 0.0
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="FP16"):
        half = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
        half.grad = torch.ones(2, dtype=torch.float16)
        ours_scaler._unscale_grads_(torch.optim.SGD([half], lr=0.1), inv, torch.zeros(()), False)


class _ApexStyleSGD(torch.optim.Optimizer):
    """An optimizer on torch's older fused contract: ``step(..., grad_scaler=...)``."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None, grad_scaler: Any = None) -> Any:  # type: ignore[override]
        del closure
        inv_scale, found = 1.0, 0.0
        if grad_scaler is not None:
            found = float(sum(v for v in grad_scaler._check_inf_per_device(self).values()))
            inv_scale = 1.0 / float(grad_scaler._get_scale_async())
        if found:
            return None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad * inv_scale, alpha=-group["lr"])
        return None


@pytest.mark.parametrize("poison", [1.0, math.inf])
def test_grad_scaler_kwarg_optimizers_work_as_with_torch(poison: float) -> None:
    ours, theirs = _model(), _model()
    results = []
    for model, scaler in (
        (ours, ShardedGradScaler("cpu", backend="local", init_scale=64.0)),
        (theirs, torch.amp.GradScaler("cpu", init_scale=64.0)),
    ):
        opt = _ApexStyleSGD(model.parameters(), lr=0.1)
        _backward(model, scaler, poison)
        # Each scaler warns in its own words that this contract is being retired.
        with pytest.warns(FutureWarning):
            scaler.step(opt)
        scaler.update()
        results.append(scaler.get_scale())
    assert results[0] == results[1] == (64.0 if poison == 1.0 else 32.0)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)


def test_last_step_skipped_is_a_device_flag_and_a_schedule_can_ignore_skips() -> None:
    model = _model()
    lr = torch.tensor(0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)  # takes a tensor lr
    scaler = ShardedGradScaler("cpu", backend="local", init_scale=64.0)
    assert scaler.last_step_skipped is None
    good_steps = torch.zeros((), dtype=torch.int64)
    history = []
    for step in range(5):
        opt.zero_grad()
        _backward(model, scaler, math.inf if step == 2 else 1.0)
        scaler.step(opt)
        scaler.update()
        skipped = scaler.last_step_skipped
        assert isinstance(skipped, torch.Tensor) and skipped.dtype is torch.bool
        # The documented recipe: count only steps that happened, on device, no host read.
        good_steps += (~skipped).to(torch.int64)
        lr.copy_(1e-3 * torch.clamp(good_steps.to(torch.float32) / 3, max=1.0))
        history.append((bool(skipped), float(lr)))
    assert [s for s, _ in history] == [False, False, True, False, False]
    # The skipped step did not advance the warm-up: lr after step 2 equals lr after step 1.
    assert history[2][1] == history[1][1]
    assert history[3][1] > history[2][1]


def test_run_step_directly_on_plain_tensors() -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) for n in (3, 50, 7)]
    result = run_step(
        grads, _config(), StepRequest(apply=Apply.NOTHING, norm_type=2.0, as_grads=True)
    )
    exact = math.sqrt(math.fsum(v * v for g in grads for v in g.double().tolist()))
    assert result.norm is not None and result.norm.dtype is torch.float32
    # float32 accumulation of 60 squares: within (n + 8) ulps of the exact value.
    assert abs(float(result.norm) - exact) <= 68 * torch.finfo(torch.float32).eps * exact
    assert float(result.found_inf) == 0.0 and result.nonfinite_ranks() == ()
    grads[1][5] = math.nan
    result = run_step(
        grads, _config(), StepRequest(apply=Apply.NOTHING, norm_type=2.0, as_grads=True)
    )
    assert float(result.found_inf) == 1.0 and math.isnan(float(result.norm))  # type: ignore[arg-type]
    assert result.nonfinite_ranks() == (0,)


def test_run_step_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="needs the scale"):
        run_step([], _config(), StepRequest(apply=Apply.UNSCALE))
    meta = torch.nn.Parameter(torch.empty(2, device="meta"))
    meta.grad = torch.empty(2, device="meta")
    with pytest.raises(GradientDeviceError, match="meta"):
        run_step([meta], _config(), StepRequest(apply=Apply.NOTHING, norm_type=2.0))


def test_fsdp1_marked_parameters_are_not_plain() -> None:
    from shardscale.core import PlainTensorAdapter, PluginNotFoundError, Registry

    flat = torch.nn.Parameter(torch.ones(4))
    flat._fsdp_flattened = True  # type: ignore[attr-defined]  # FSDP1's mark
    assert not PlainTensorAdapter().claims(flat)
    registry = Registry(load_entry_points=False)
    registry.register(_CoreOnly(), name="core-only")
    with pytest.raises(PluginNotFoundError, match="shardscale-fsdp"):
        registry.adapter_for(flat)


class _CoreOnly:
    from shardscale.core import hookimpl

    @hookimpl
    def shardscale_grad_adapters(self) -> list[object]:
        from shardscale.core import PlainTensorAdapter

        return [PlainTensorAdapter()]


def test_no_warning_in_an_ordinary_loop() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", backend="local")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            opt.zero_grad()
            _backward(model, scaler)
            scaler.step(opt)
            scaler.update()


class _RecordingKernels:
    """foreach kernels that record each ``tensor_norms`` call's p (highest priority on the CPU)."""

    name = "recording-kernels"
    priority = 1000

    def __init__(self, *, safe: bool) -> None:
        from shardscale.core import ForeachKernels

        self._inner = ForeachKernels()
        self.calls: list[float] = []
        if safe:
            self.overflow_safe_norms = True

    def supports(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def unscale_and_check_(self, tensors: Any, found_inf: Any, inv_scale: Any) -> None:
        self._inner.unscale_and_check_(tensors, found_inf, inv_scale)

    def tensor_norms(self, tensors: Any, norm_type: float) -> torch.Tensor:
        self.calls.append(norm_type)
        return self._inner.tensor_norms(tensors, norm_type)

    def mul_(self, tensors: Any, coef: torch.Tensor) -> None:
        self._inner.mul_(tensors, coef)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_overflow_safe_kernels_are_read_once_for_every_p(dtype: torch.dtype) -> None:
    # The optional StatsKernels attribute: kernels that keep powers from overflowing themselves
    # are called once; the others get the engine's max read and a second, normalised read --
    # except a 2-norm, read once (float64 on the CPU too: read again only when it overflowed).
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen, dtype=dtype) for n in (3, 50, 7)]
    exact = math.fsum(abs(v) ** 3 for g in grads for v in g.double().tolist()) ** (1 / 3)
    registry = get_registry()
    norms = {}
    for safe in (False, True):
        kernels = _RecordingKernels(safe=safe)
        name = registry.register(_KernelsPlugin(kernels), name=f"recording-{safe}")
        try:
            for p in (3.0, 2.0):
                kernels.calls.clear()
                result = run_step(
                    grads, _config(), StepRequest(apply=Apply.NOTHING, norm_type=p, as_grads=True)
                )
                norms[(safe, p)] = float(result.norm)  # type: ignore[arg-type]
                plain = p == 2.0
                assert kernels.calls == ([p] if safe or plain else [math.inf, p])
        finally:
            registry.unregister(name)
    # Both paths give the 3-norm within the rounding bound of 60 terms (see tolerances.py).
    u = torch.finfo(torch.float32 if dtype is torch.float32 else dtype).eps / 2
    for safe in (False, True):
        assert abs(norms[(safe, 3.0)] - exact) <= (60 + 8) * u * 2 * exact + u * exact


class _KernelsPlugin:
    def __init__(self, kernels: object) -> None:
        self.kernels = kernels

    @hookimpl
    def shardscale_stats_kernels(self) -> list[object]:
        return [self.kernels]


# -- the engine module's shape (issue 18) --------------------------------------------------------


def test_the_reduced_vector_note_names_the_layouts_blocks_in_order() -> None:
    # "[Note: the reduced vector]" must match the code: its table lists VectorLayout's blocks.
    import re

    from shardscale.core.step import VectorLayout
    from shardscale.core.step import _engine as engine

    doc = engine.__doc__ or ""
    # The note itself (a header on its own line), not the mentions of it.
    note = doc[doc.index("\n[Note: the reduced vector]\n") : doc.index("\n[Note: declarations]\n")]
    rows = re.findall(r"^(\w+)\s{2,}\S", note, flags=re.MULTILINE)
    assert rows[0] == "block"  # the table's header row
    assert tuple(rows[1:]) == VectorLayout.PER_RANK
    w = 3
    layout = VectorLayout(w)
    assert f"{len(VectorLayout.PER_RANK)}·W + {len(VectorLayout.SHARED)}" in note
    assert layout.size == len(VectorLayout.PER_RANK) * w + len(VectorLayout.SHARED)
    # Blocks tile the vector without overlap.
    covered = [i for name in VectorLayout.PER_RANK for i in range(layout.size)[layout.block(name)]]
    assert covered == list(range(len(VectorLayout.PER_RANK) * w))
    starts = [layout.block(name).start for name in VectorLayout.PER_RANK]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    shared = [layout.shared(name) for name in VectorLayout.SHARED]
    assert shared == list(range(len(VectorLayout.PER_RANK) * w, layout.size))


def test_errors_are_classified_by_type_not_by_message() -> None:
    from shardscale.core import DeclarationError, GradientDtypeError, LayoutError
    from shardscale.core.step._errors import ERROR_KINDS, error_code

    def code_of(kind: type[BaseException]) -> int:
        return next(i for i, (k, _) in enumerate(ERROR_KINDS, start=1) if k is kind)

    assert error_code(GradientDtypeError("anything")) == code_of(GradientDtypeError)
    # A TypeError that merely mentions floating point is a bad argument, not a dtype error.
    assert error_code(TypeError("must be real floating point")) != code_of(GradientDtypeError)
    assert error_code(DeclarationError("x")) == code_of(DeclarationError)
    assert error_code(LayoutError("x")) == code_of(LayoutError)  # a ValueError, but specific
    assert error_code(KeyError("x")) == len(ERROR_KINDS) + 1  # unexpected
    assert all(error_code(kind("x")) > 0 for kind in (ValueError, RuntimeError))


def test_an_integer_gradient_is_a_gradient_dtype_error() -> None:
    from shardscale.core import GradientDtypeError

    p = torch.zeros(3, dtype=torch.int64)
    p.grad = torch.ones(3, dtype=torch.int64)
    with pytest.raises(GradientDtypeError, match="real floating point"):
        run_step([p], _config(), StepRequest(apply=Apply.NOTHING, norm_type=2.0))
