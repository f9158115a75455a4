"""PyTorch's own tests of these APIs, ported to the CPU: torch and shardscale side by side.

Ported by behaviour (rewritten here, not copied) from pytorch's
``test/test_torch.py`` (the ``test_grad_scaling_*`` tests: ``_unscale_grads_``
on dense and sparse gradients, clipping with and without a separate
``unscale_``, a gradient penalty, accumulation, several models and optimizers),
``test/distributed/fsdp/test_fsdp_sharded_grad_scaler.py`` (``TestShardGradScaler``)
and ``test/nn/test_clip_grad.py`` (``clip_grad_norm_``, ``get_total_norm``,
``error_if_nonfinite``, the result's dtype). Each case runs torch's
implementation and ours in this process on identical inputs and compares
them; where shardscale differs on purpose (docs/migration.md, "Every
deliberate difference") the test says so and checks our side of it.

The multi-rank FSDP1 cases (the "no gradients" warning, half-precision norms
of a sharded model) are in ``integration_tests/test_torch_parity_fsdp1.py``.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tolerances import clipped_grad_rtol, norm_rtol
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchFSDP1Scaler

from shardscale.core import AliasedGradientError, ShardedGradScaler
from shardscale.core.scaler import OptState

Clip = Callable[..., torch.Tensor]


def _clip_api() -> tuple[Clip, Clip]:
    clip = pytest.importorskip("shardscale.clip")
    return clip.clip_grad_norm_, clip.get_total_norm


# -- _unscale_grads_ (test_torch.py: test_grad_scaling_unscale, ..._unscale_sparse) ----------------


def _storm(g: torch.Tensor, inject: int) -> list[torch.Tensor]:
    # Contiguous, strided and float16 gradients in one optimizer: the scaler must bucket them.
    grads = [g.clone(), g.clone()[:, :5], g.half(), g.half()]
    if inject >= 0:
        grads[inject][2, 2] = math.inf
    return grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_unscale_grads_on_dense_gradients_like_torch(dtype: torch.dtype) -> None:
    g = torch.full((20, 20), 4.0, dtype=dtype)
    for inject in range(-1, 4):
        flags, results = [], []
        for scaler in (torch.amp.GradScaler("cpu"), ShardedGradScaler("cpu")):
            params = [torch.empty_like(t) for t in _storm(g, -1)]
            for p, t in zip(params, _storm(g, inject), strict=True):
                p.grad = t
            inv_scale = torch.full((1,), 0.25)
            found_inf = torch.zeros(1)
            # A fresh scaler that never scaled a loss, called the way torch's test calls it.
            per_device = scaler._unscale_grads_(
                torch.optim.SGD(params, lr=1.0), inv_scale, found_inf, True
            )
            flags.append(sum(float(v.sum()) for v in per_device.values()))
            assert float(found_inf.sum()) == 0.0  # the argument is left alone; the dict answers
            results.append([p.grad for p in params])
        assert flags[0] == flags[1] == (1.0 if inject >= 0 else 0.0)
        for ours, theirs in zip(results[1], results[0], strict=True):
            assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())  # the same kernel
        if inject < 0:
            assert all(torch.equal(t, torch.ones_like(t)) for t in results[1])


def _sparse(values: list[float], dtype: torch.dtype, idx: list[list[int]]) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor(idx), torch.tensor(values, dtype=dtype), (2, 3))


@pytest.mark.parametrize(
    ("values", "dtype", "idx", "overflow"),
    [
        ([16.0, 32.0, 64.0], torch.float32, [[0, 1, 1], [2, 0, 2]], False),
        ([16.0, 32.0, math.inf], torch.float32, [[0, 1, 1], [2, 0, 2]], True),
        # Two duplicates of 2^15 sum to inf in float16 once coalesced, as torch coalesces.
        ([2.0**15, 2.0**15, 1.0], torch.float16, [[1, 1, 1], [0, 0, 2]], True),
        ([2.0**14, 2.0**13, 1.0], torch.float16, [[1, 1, 1], [0, 0, 2]], False),
    ],
    ids=["fp32", "fp32-inf", "fp16-coalesced-overflow", "fp16-coalesced"],
)
def test_unscale_grads_on_sparse_gradients_like_torch(
    values: list[float], dtype: torch.dtype, idx: list[list[int]], overflow: bool
) -> None:
    seen = []
    for scaler in (torch.amp.GradScaler("cpu"), ShardedGradScaler("cpu")):
        s = _sparse(values, dtype, idx)
        param = s.clone()
        param.grad = s.clone()
        found_inf = torch.zeros(1)
        opt = torch.optim.SGD([param], lr=1.0)
        per_device = scaler._unscale_grads_(opt, torch.full((1,), 0.5), found_inf, True)
        assert float(found_inf) == 0.0 and per_device[param.device] is not found_inf
        seen.append((float(per_device[param.device]), param.grad))
    (theirs_flag, theirs), (ours_flag, ours) = seen
    assert ours_flag == theirs_flag == float(overflow)
    assert ours.is_sparse and ours.is_coalesced() == theirs.is_coalesced()
    assert torch.equal(ours.to_dense().nan_to_num(), theirs.to_dense().nan_to_num())
    if not overflow:
        expected = _sparse(values, dtype, idx).to_dense() / 2
        assert torch.equal(ours.to_dense(), expected)


def test_unscale_grads_refuses_fp16_unless_allowed_like_torch() -> None:
    for scaler in (torch.amp.GradScaler("cpu"), ShardedGradScaler("cpu")):
        param = torch.zeros(3, dtype=torch.float16)
        param.grad = torch.ones(3, dtype=torch.float16)
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
            scaler._unscale_grads_(
                torch.optim.SGD([param], lr=1.0), torch.ones(1), torch.zeros(1), False
            )
        assert torch.equal(param.grad, torch.ones(3, dtype=torch.float16))


# -- FSDP1's ShardedGradScaler (test_fsdp_sharded_grad_scaler.py, TestShardGradScaler) -----------


def test_fsdp1_sparse_unscaling_sequence_like_torch() -> None:
    # torch's sequence, including its quirk: the third call rebinds ``s1`` but the optimizer
    # still holds the parameter of the first two calls, whose gradient now holds an inf.
    def run(scaler: Any) -> list[tuple[float, torch.Tensor]]:
        out = []
        inv_scale = torch.full((1,), 0.5)
        found_inf = torch.zeros(1)
        s = _sparse([16.0, 32.0, 64.0], torch.float32, [[0, 1, 1], [2, 0, 2]])
        s1 = s.clone()
        s1.grad = s.clone()
        opt = torch.optim.SGD([s1], lr=1.0)
        found_inf.zero_()
        found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device]
        out.append((float(found_inf), s1.grad.to_dense()))
        s1.grad = _sparse([16.0, 32.0, math.inf], torch.float32, [[0, 1, 1], [2, 0, 2]])
        found_inf.zero_()
        found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device]
        out.append((float(found_inf), s1.grad.to_dense()))
        s1 = _sparse([2.0**15, 2.0**15, 1.0], torch.float16, [[1, 1, 1], [0, 0, 2]])
        s1.grad = s1.clone()
        found_inf.zero_()
        found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device]
        out.append((float(found_inf), s1.grad.to_dense()))
        return out

    theirs = run(TorchFSDP1Scaler("cpu", init_scale=2.0))
    ours = run(ShardedGradScaler("cpu", init_scale=2.0))
    assert [f for f, _ in ours] == [f for f, _ in theirs] == [0.0, 1.0, 1.0]
    for (_, a), (_, b) in zip(ours, theirs, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    expected = _sparse([8.0, 16.0, 32.0], torch.float32, [[0, 1, 1], [2, 0, 2]]).to_dense()
    assert torch.equal(ours[0][1], expected)


class _OneRankGroup:
    """What torch's FSDP1 test passes as its scaler's group: one rank, all_reduce is a no-op."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> Any:
        del opts
        future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        future.set_result(tensors)

        class _Done:
            def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
                return future

            def wait(self) -> bool:
                return True

        return _Done()


def test_fsdp1_inf_gradient_skips_the_step_like_torch() -> None:
    # torch's test gives its scaler a one-rank stand-in group (no process group here).
    theirs = TorchFSDP1Scaler("cpu", init_scale=2.0, process_group=_OneRankGroup())
    for scaler in (theirs, ShardedGradScaler("cpu", init_scale=2.0)):
        t0 = torch.tensor([math.inf])
        t0.grad = t0.clone()
        before = t0.clone()
        opt = torch.optim.SGD([t0], lr=1.0)
        scaler.scale(torch.full((1,), 4.0))
        assert scaler.step(opt) is None
        assert torch.equal(t0, before)


# -- scaler edge cases (test_torch.py / test_cuda.py) ----------------------------------------------


def _adam_run(scaler: Any, *, invalidate: bool) -> tuple[list[torch.Tensor], float]:
    torch.manual_seed(3)
    model = nn.Linear(5, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 5), torch.randn(4, 1)
    for _ in range(3):
        opt.zero_grad()
        scaler.scale((model(x) - y).abs().sum()).backward()
        if invalidate:
            # Gradients replaced between unscale_ and step: the recorded decision still holds.
            scaler.unscale_(opt)
            for p in model.parameters():
                p.grad = None
            scaler.scale((model(x) - y).abs().sum()).backward()
        scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in model.parameters()], scaler.get_scale()


@pytest.mark.parametrize("invalidate", [False, True], ids=["plain", "grads-replaced"])
def test_scale_near_float32_max_and_replaced_grads_like_torch(invalidate: bool) -> None:
    # torch's "grad scale will not overflow" (growth past float32's max is refused) and
    # "params invalidated with grads invalidated between unscale and step".
    args: dict[str, Any] = {"growth_interval": 1, "growth_factor": 2.0**4, "init_scale": 1e38}
    theirs, theirs_scale = _adam_run(torch.amp.GradScaler("cpu", **args), invalidate=invalidate)
    ours, ours_scale = _adam_run(ShardedGradScaler("cpu", **args), invalidate=invalidate)
    assert ours_scale == theirs_scale and math.isfinite(ours_scale)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)


# -- whole loops (test_torch.py: clipping, separate unscale, penalty, accumulation, several) ------

_SKIP_ITER = 2
_MAX_NORM = 0.2


def _models(n: int) -> list[nn.Sequential]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).double()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
        out.append(model)
    return out


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(12)
    return [
        (
            torch.randn(8, 8, generator=gen, dtype=torch.float64),
            torch.randn(8, 8, generator=gen, dtype=torch.float64),
        )
        for _ in range(4)
    ]


def _poison(model: nn.Sequential) -> None:
    grad = model[1].weight.grad
    assert grad is not None
    grad.fill_(math.inf)


def _loop(kind: str, scaler: Any, clip: Clip) -> tuple[list[nn.Sequential], list[float]]:
    models = _models(2 if kind == "several" else 1)
    opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in models]
    loss_fn = nn.MSELoss()
    model, opt = models[0], opts[0]
    scales = []
    for i, (x, target) in enumerate(_data()):
        if kind == "clip":  # clip the scaled gradients against a scaled limit
            opt.zero_grad()
            scaler.scale(loss_fn(model(x), target)).backward()
            clip(model.parameters(), _MAX_NORM * scaler.get_scale())
            if i == _SKIP_ITER:
                _poison(model)
        elif kind == "unscale-then-clip":
            opt.zero_grad()
            scaler.scale(loss_fn(model(x), target)).backward()
            if i == _SKIP_ITER:
                _poison(model)
            scaler.unscale_(opt)
            clip(model.parameters(), _MAX_NORM, error_if_nonfinite=False)
        elif kind == "penalty":  # a gradient penalty through autograd.grad on the scaled loss
            opt.zero_grad()
            loss = loss_fn(model(x), target)
            scaled = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
            inv_scale = 1.0 / scaler.get_scale()
            penalty = torch.stack([(g * inv_scale).pow(2).sum() for g in scaled]).sum().sqrt()
            scaler.scale(loss + penalty).backward()
            if i == _SKIP_ITER:
                _poison(model)
        elif kind == "accumulate":  # two micro-batches per step
            scaler.scale(loss_fn(model(x), target) / 2).backward()
            if (i + 1) % 2:
                continue
            if i == 3:  # the second step overflows
                _poison(model)
        elif kind == "several":  # two models, two losses, two optimizers, one scaler
            for o in opts:
                o.zero_grad()
            a, b = models[0](x), models[1](x)
            scaler.scale(loss_fn(0.3 * a + 0.7 * b, target)).backward(retain_graph=True)
            scaler.scale(loss_fn(0.6 * a - 0.4 * b, target)).backward()
            if i == _SKIP_ITER:
                _poison(models[1])
            scaler.unscale_(opts[0])
        for o in opts:
            scaler.step(o)
        scaler.update()
        if kind == "accumulate":
            opt.zero_grad()
        scales.append(scaler.get_scale())
    return models, scales


@pytest.mark.parametrize("kind", ["clip", "unscale-then-clip", "penalty", "accumulate", "several"])
def test_training_loops_match_torch(kind: str) -> None:
    ours_clip, _ = _clip_api() if kind in ("clip", "unscale-then-clip") else (None, None)
    args = {"init_scale": 2.0**10, "growth_interval": 1}
    theirs, theirs_scales = _loop(
        kind, torch.amp.GradScaler("cpu", **args), torch.nn.utils.clip_grad_norm_
    )
    ours, ours_scales = _loop(
        kind, ShardedGradScaler("cpu", **args), ours_clip or (lambda *a, **k: torch.zeros(()))
    )
    # The same decisions: the inf step is skipped and the scale backs off in both.
    assert ours_scales == theirs_scales
    assert any(b < a for a, b in itertools.pairwise(ours_scales))
    for m_ours, m_theirs in zip(ours, theirs, strict=True):
        for p, q in zip(m_ours.parameters(), m_theirs.parameters(), strict=True):
            if ours_clip is None:
                assert torch.equal(p, q)  # the scaler alone: torch's kernels, bit for bit
            else:
                # float64 gradients, float32 clip coefficient (ours): each step's update
                # differs by at most clipped_grad_rtol; 4 steps, doubled for propagation.
                n = sum(t.numel() for t in m_ours.parameters())
                tol = 8 * clipped_grad_rtol(n, torch.float64, 2.0)
                torch.testing.assert_close(p, q, rtol=tol, atol=tol)


# -- clip_grad_norm_ / get_total_norm (test/nn/test_clip_grad.py) --------------------------------


def _linear_with_grads() -> nn.Linear:
    layer = nn.Linear(10, 10)
    layer.weight.grad = torch.arange(1.0, 101).view(10, 10)
    layer.bias.grad = torch.ones(10).div(1000)
    return layer


@pytest.mark.parametrize("norm_type", [0.5, 1.5, 2.0, 4.0, math.inf])
@pytest.mark.parametrize("foreach", [None, True, False])
def test_clip_grad_norm_like_torch(norm_type: float, foreach: bool | None) -> None:
    clip, total = _clip_api()
    n = 110
    bound = norm_rtol(n, torch.float32, norm_type)
    for max_norm in (1.25, 1e9):  # clipped, and far above the norm (unchanged)
        theirs, ours = _linear_with_grads(), _linear_with_grads()
        ref = torch.nn.utils.clip_grad_norm_(
            theirs.parameters(), max_norm, norm_type, foreach=foreach
        )
        got = clip(ours.parameters(), max_norm, norm_type, foreach=foreach)
        assert got.dtype is ref.dtype is torch.float32
        assert float(got) == pytest.approx(float(ref), rel=2 * bound)
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            rtol = 2 * clipped_grad_rtol(n, torch.float32, norm_type)
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=0)
        if max_norm > 1e6:
            assert torch.equal(ours.weight.grad, torch.arange(1.0, 101).view(10, 10))  # type: ignore[arg-type]
    # A single tensor, and get_total_norm of the gradients themselves.
    theirs, ours = _linear_with_grads(), _linear_with_grads()
    ref = torch.nn.utils.clip_grad_norm_(theirs.weight, 1.25, norm_type)
    assert float(clip(ours.weight, 1.25, norm_type)) == pytest.approx(float(ref), rel=2 * bound)
    grads = [
        g
        for g in (_linear_with_grads().weight.grad, _linear_with_grads().bias.grad)
        if g is not None
    ]
    ref = torch.nn.utils.get_total_norm(grads, norm_type)
    assert float(total(grads, norm_type)) == pytest.approx(float(ref), rel=2 * bound)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_clip_grad_norm_error_if_nonfinite_like_torch(bad: float, norm_type: float) -> None:
    clip, _ = _clip_api()
    for error in (True, False):
        outcomes = []
        for fn in (torch.nn.utils.clip_grad_norm_, clip):
            layer = _linear_with_grads()
            assert layer.weight.grad is not None
            layer.weight.grad[3, 4] = bad
            before = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
            try:
                norm = fn(layer.parameters(), 1.0, norm_type, error_if_nonfinite=error)
            except RuntimeError:
                after = [p.grad for p in layer.parameters() if p.grad is not None]
                # Refused before any gradient changed.
                assert all(
                    torch.equal(a.nan_to_num(), b.nan_to_num())
                    for a, b in zip(after, before, strict=True)
                )
                outcomes.append(("raised", None, None))
                continue
            grads = torch.cat(
                [p.grad.reshape(-1) for p in layer.parameters() if p.grad is not None]
            )
            outcomes.append(("returned", math.isnan(float(norm)), grads))
        (how_t, nan_t, grads_t), (how_o, nan_o, grads_o) = outcomes
        assert how_o == how_t == ("raised" if error else "returned")
        if not error:
            assert nan_o == nan_t
            assert torch.equal(grads_o.isnan(), grads_t.isnan())  # type: ignore[union-attr]
            assert torch.equal(grads_o.nan_to_num(), grads_t.nan_to_num())  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float16,),
        (torch.bfloat16,),
        (torch.float32,),
        (torch.float64,),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float16),
        (torch.float16, torch.float64),
    ],
    ids=lambda d: "+".join(str(x).removeprefix("torch.") for x in d),
)
def test_norm_dtype_is_torchs(dtypes: tuple[torch.dtype, ...]) -> None:
    # torch returns the promotion of the gradients' dtypes; so does shardscale (it computes in
    # float32/float64 and casts the result).
    clip, total = _clip_api()
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(37, generator=gen).to(d) for d in dtypes]
    ref = torch.nn.utils.get_total_norm(grads)
    got = total(grads)
    assert got.dtype is ref.dtype
    # Both are within their bound of the exact norm of these values: accumulated in float32 at
    # least (torch accumulates half precision in float32 per tensor too), then rounded once
    # more to the result dtype.
    exact = float(torch.linalg.vector_norm(torch.cat([g.double() for g in grads])))
    n = len(grads) * 37
    bound = 2 * norm_rtol(n, torch.float32, 2.0) + torch.finfo(ref.dtype).eps
    assert float(got) == pytest.approx(exact, rel=bound)
    # torch also rounds each tensor's norm to that tensor's dtype before combining them.
    per_tensor = max(torch.finfo(d).eps for d in dtypes)
    assert float(ref) == pytest.approx(exact, rel=bound + per_tensor)
    params = []
    for g in grads:
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    assert clip(params, 1.0).dtype is ref.dtype


def test_no_gradients_like_torch() -> None:
    clip, total = _clip_api()
    ref = torch.nn.utils.clip_grad_norm_([nn.Parameter(torch.ones(3))], 1.0)
    with pytest.warns(UserWarning, match="with no gradients"):  # FSDP1's warning, see its test
        got = clip([nn.Parameter(torch.ones(3))], 1.0)
    assert got.dtype is ref.dtype and float(got) == float(ref) == 0.0
    empty = torch.nn.utils.get_total_norm([])
    assert total([]).dtype is empty.dtype and float(total([])) == 0.0


# -- aliased gradients (issue 18, item 13) -----------------------------------------------------


def _aliased() -> tuple[nn.Parameter, nn.Parameter, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    a, b = nn.Parameter(torch.randn(4, generator=gen)), nn.Parameter(torch.randn(4, generator=gen))
    g = torch.randn(4, generator=gen) * 16
    a.grad = b.grad = g
    return a, b, g


def test_torch_applies_an_aliased_gradient_twice() -> None:
    # What torch does, measured here: the reason shardscale refuses instead of matching it.
    a, b, g = _aliased()
    g0 = g.clone()
    norm = torch.nn.utils.clip_grad_norm_([a, b], 1.0)
    assert float(norm) == pytest.approx(math.sqrt(2) * float(g0.norm()), rel=1e-6)  # counted twice
    coef = 1.0 / (float(norm) + 1e-6)
    torch.testing.assert_close(g, g0 * coef * coef)  # and multiplied twice
    a, b, g = _aliased()
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(torch.optim.SGD([a, b], lr=1.0))
    torch.testing.assert_close(g, g0 / 256)  # unscaled twice: 1/scale²


def test_aliased_gradients_are_refused_before_anything_changes() -> None:
    clip, total = _clip_api()
    from shardscale.clip import unscale_and_clip_

    for call in ("clip", "unscale_", "unscale_and_clip_", "step"):
        a, b, g = _aliased()
        g0 = g.clone()
        scaler = ShardedGradScaler("cpu", init_scale=16.0)
        scaler.scale(torch.ones(()))
        opt = torch.optim.SGD([a, b], lr=1.0)
        with pytest.raises(AliasedGradientError, match="share one gradient tensor"):
            if call == "clip":
                clip([a, b], 1.0)
            elif call == "unscale_":
                scaler.unscale_(opt)
            elif call == "unscale_and_clip_":
                unscale_and_clip_(scaler, opt, 1.0)
            else:
                scaler.step(opt)
        assert torch.equal(g, g0) and torch.equal(a.detach(), _aliased()[0].detach())
        if call != "clip":
            assert scaler._per_optimizer_states[id(opt)].stage is OptState.READY
            b.grad = g.clone()  # fixed: each parameter its own gradient
            scaler.unscale_(opt)
            torch.testing.assert_close(a.grad, g0 / 16)
    a, _, g = _aliased()
    with pytest.raises(AliasedGradientError, match="passed twice"):
        clip([a, a], 1.0)
    # get_total_norm reads gradients and writes nothing: a tensor given twice counts twice,
    # as in torch (the norm of the list as given).
    ref = torch.nn.utils.get_total_norm([g, g])
    assert float(total([g, g])) == pytest.approx(
        float(ref), rel=2 * norm_rtol(8, torch.float32, 2.0)
    )


def test_disjoint_views_of_one_buffer_are_not_aliased() -> None:
    # DDP's gradient_as_bucket_view and FSDP1's use_orig_params give views of one flat buffer.
    clip, _ = _clip_api()
    flat = torch.arange(1.0, 11.0)
    a, b = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(6))
    a.grad, b.grad = flat[:4], flat[4:]
    ref_a, ref_b = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(6))
    ref_a.grad, ref_b.grad = flat[:4].clone(), flat[4:].clone()
    ref = torch.nn.utils.clip_grad_norm_([ref_a, ref_b], 1.0)
    got = clip([a, b], 1.0)
    assert float(got) == pytest.approx(float(ref), rel=2 * norm_rtol(10, torch.float32, 2.0))
    rtol = 2 * clipped_grad_rtol(10, torch.float32, 2.0)
    torch.testing.assert_close(flat, torch.cat([ref_a.grad, ref_b.grad]), rtol=rtol, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedGradScaler("cpu").unscale_(torch.optim.SGD([a, b], lr=1.0))
