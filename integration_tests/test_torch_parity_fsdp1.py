"""PyTorch's FSDP1 clipping tests, ported to gloo: ``clip_grad_norm_`` beside ``FSDP.clip_grad_norm_``.

Ported by behaviour from pytorch's ``test/distributed/fsdp/test_fsdp_clip_grad_norm.py``
(a rank without gradients warns and returns a float32 zero; half-precision
gradients give a half-precision norm). Each case runs FSDP1's own method and
``shardscale.clip.clip_grad_norm_`` on two copies of one model in the same
processes and compares them. The single-process ports are in
``packages/shardscale-core/tests/test_torch_parity.py``.
"""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool
from tolerances import clipped_grad_rtol, norm_rtol
from torch import nn

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _fsdp(module: nn.Module, **mixed: Any) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    return FSDP(
        module,
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        mixed_precision=MixedPrecision(param_dtype=torch.float16, **mixed),
        device_id=torch.device("cpu"),
    )


def _no_gradients_case() -> dict[str, Any]:
    from shardscale.clip import clip_grad_norm_

    torch.manual_seed(0)
    theirs = _fsdp(nn.Linear(24, 24), reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    torch.manual_seed(0)
    ours = _fsdp(nn.Linear(24, 24), reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    x = torch.randn(32, 24)
    out: dict[str, Any] = {}
    for name, model, clip in (
        ("theirs", theirs, lambda m: m.clip_grad_norm_(1)),
        ("ours", ours, lambda m: clip_grad_norm_(m.parameters(), 1)),
    ):
        model(x)  # forward only: no gradient anywhere
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            norm = clip(model)
        out[name] = {
            "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
            "dtype": str(norm.dtype),
            "value": float(norm),
        }
    return out


def test_a_rank_without_gradients_warns_as_fsdp1(pool2: Pool) -> None:
    for rank, result in enumerate(pool2.run(_no_gradients_case)):
        # The regex torch's own FSDP1 test matches against FSDP.clip_grad_norm_.
        pattern = (
            rf"on rank {rank} with no gradients -- returning the total norm in the default dtype "
            r"torch\.float32"
        )
        for side in ("theirs", "ours"):
            assert any(re.search(pattern, w) for w in result[side]["warnings"]), result[side]
            assert result[side]["dtype"] == "torch.float32" and result[side]["value"] == 0.0


def _half_grads_case(norm_type: float, max_norm: float) -> dict[str, Any]:
    from shardscale.clip import clip_grad_norm_

    torch.manual_seed(1)
    base = nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 5))
    # keep_low_precision_grads: the gradients stay float16, as FSDP1's test of this path has.
    theirs = _fsdp(copy.deepcopy(base), keep_low_precision_grads=True)
    ours = _fsdp(copy.deepcopy(base), keep_low_precision_grads=True)
    torch.manual_seed(2 + dist.get_rank())
    x = torch.randn(8, 16)
    results: dict[str, Any] = {}
    for name, model in (("theirs", theirs), ("ours", ours)):
        model(x).float().pow(2).sum().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(g.dtype is torch.float16 for g in grads)
        if name == "theirs":
            norm = model.clip_grad_norm_(max_norm, norm_type)  # type: ignore[operator]
        else:
            norm = clip_grad_norm_(model.parameters(), max_norm, norm_type)
        results[name] = {
            "dtype": str(norm.dtype),
            "value": float(norm),
            "grads": [p.grad.float().clone() for p in model.parameters() if p.grad is not None],
            "numel": sum(p.numel() for p in base.parameters()),
        }
    return results


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_half_precision_gradients_give_fsdp1s_dtype_and_value(
    pool2: Pool, norm_type: float
) -> None:
    results = pool2.run(_half_grads_case, norm_type, 0.5)
    values = set()
    for result in results:
        theirs, ours = result["theirs"], result["ours"]
        assert ours["dtype"] == theirs["dtype"] == "torch.float16"
        # Both accumulate in float32 and round the result to float16 once.
        n = ours["numel"]
        bound = 2 * norm_rtol(n, torch.float16, norm_type) + torch.finfo(torch.float16).eps
        assert ours["value"] == pytest.approx(theirs["value"], rel=bound)
        values.add(ours["value"])
        # Clipped float16 gradients: the coefficient's rounding, then one float16 rounding each.
        rtol = 2 * clipped_grad_rtol(n, torch.float16, norm_type)
        atol = torch.finfo(torch.float16).smallest_normal
        for a, b in zip(ours["grads"], theirs["grads"], strict=True):
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    assert len(values) == 1  # the same norm on every rank
