"""The step engine: every rank reads, reduces and decides in one place.

[Note: one step, top to bottom]
Every caller that looks at gradients before an optimizer step --
``ShardedGradScaler.unscale_``/``step``/``clip_grad_norm_``,
``shardscale.clip``'s ``unscale_and_clip_``, ``clip_grad_norm_``,
``get_total_norm`` and ``StreamingStats`` -- is a thin caller of
:func:`run_step`, which takes a frozen :class:`StepRequest` through these
stages, each a function below, in this order:

1. **collect**: each parameter's gradient is described by the adapter that
   claims it (local tensor, whether this rank's copy *counts* towards sums);
2. **check**: the options against the contract (``_contract``), the devices,
   the kernels, the declarations against the parameters. Anything wrong on
   this rank is *recorded*, never raised yet: peers are about to wait for this
   rank in the all-reduce, so it must join it (see [Note: errors that reach
   every rank] in ``_step_errors``);
3. **read**: each local gradient is read once. The non-finite flag covers
   *every* local gradient, counted or not (replicas drift, a rank may hold a
   gradient others lack); the norm's statistics cover only the counted ones;
4. **reduce**: ONE all-reduce (SUM) of a small float64 vector in which each
   rank fills its own slots (see [Note: the reduced vector]);
5. **decide**: found_inf, the norm, the clip coefficient and the verdict
   (skip, and why: ``_verdict``) follow from the vector, identically on every
   rank; an error or a disagreement anywhere makes every rank raise, naming
   the ranks;
6. **apply**: one in-place multiply, or nothing and a ``grad_scale`` for a
   fused optimizer.

[Note: the reduced vector]
With W ranks in the reduction group, rank r writes only slot r of each block
and zeros elsewhere, so the SUM all-reduce is exact (adding zeros) and every
rank receives every rank's numbers. The blocks are named in code by
:class:`~shardscale.core.step._vector.VectorLayout`, in this order:

============  ===========================================================
block         rank r's slot
============  ===========================================================
peak          M_r: max over its counted tensors of the tensor's p-norm
              (finite ones)
scaled_sum    S_r: Σ_t (n_t / M_r)^p over the same tensors, each term ≤ 1
nonfinite     how many of its local gradients hold inf/nan
status        code·2^48 + chain·2^24 + declarations: its error code (0:
              none; ``_step_errors.ERROR_KINDS``, < 2^4), a 24-bit
              fingerprint of its backend chain's names and one of what must
              agree (see [Note: declarations]); < 2^52, an exact float64
============  ===========================================================

plus two values every rank adds to: ``nan``, how many of the non-finite
gradients hold nan (the reported norm is nan then, else inf), and
``loss_nonfinite``, how many ranks observed a non-finite loss (see [Note: the
verdict] in ``_verdict``). The global norm
is M·(Σ_r S_r (M_r/M)^p)^(1/p) with M = max_r M_r: no intermediate exceeds the
norm itself, so the combination cannot overflow for any p > 0. Its size is
4·W + 2 numbers: 32 KiB for 1024 ranks, 4 MiB for 131 072. The device reads
every flag of the decision from it in a handful of ops (``_step_arith``): one
``ne`` against what this rank expects (every count 0, every status its own, or
-1 where it failed itself), so a rank failed or ranks disagree exactly when a
status flag is set on every rank, and the weighted ``amax`` of the flags is the
step's skip reason. The norm's dtype is
decided on each rank from its own gradients (float64 if it reads float64 ones,
as torch), so ranks agree whenever they hold the same parameter dtypes.

Why per-rank slots, not a constant-size vector (docs/benchmark.md, the scale
table): NCCL's own tuning model puts this vector's all-reduce at 1.05x an
8-byte one at 1 024 ranks, 1.79x at 16 384, 1.88x at 65 536 and 1.93x at
131 072 (H100 nodes of 8, 400 Gb/s per GPU): about 0.15 ms more per step at
10^5 ranks (with 6·W + 2 values, before ``status`` was packed: 1.95x and
2.03x). The per-rank nonfinite counts feed every step's
``StepRecord.nonfinite_per_rank`` without a host sync, which a constant-size
SUM cannot carry. What did grow with W on every step was host work: it now
reads one device-computed number (the reason), not the W status slots
(``ErrorBlocks``), so
the decision costs O(1) host work and O(W) device work (simulated at 131 072
ranks on one CPU thread: 137 ms -> 4-7 ms per step).

Ranks whose chain fingerprints differ raise together: they reached the same
collective through different middleware, which can mismatch and hang the
next time (a scaler also checks once, beside the chain, before its first
step, so a mismatch that would hang at once is caught too).

[Note: declarations]
How a norm counts plain tensors rests on what each rank declares: a plain
tensor is a replica (counted on group rank 0 only) unless ``"*"`` is in
``distinct_dims`` or it is in this rank's ``distinct_params``; a DTensor's
replicas along the mesh dims named in ``distinct_dims`` count as different
parameters. A wrong declaration on one rank gives a wrong norm on every rank,
so the declarations are checked twice:

* on each rank, against its parameters (check stage): every name of
  ``distinct_dims`` other than ``"*"`` must be a dim of these parameters'
  meshes -- and a step whose parameters are all plain tensors has no mesh, so
  a name there is refused with its fix (``"*"`` or ``distinct_params``);
  every ``distinct_params`` tensor must be one of the step's tensors;
* across ranks, in the same all-reduce: each rank fingerprints what must be
  the same on every rank of a norm step -- the sorted ``distinct_dims``,
  ``norm_type`` and ``max_norm``, and the shapes and dtypes of the plain
  tensors of the step it treats as replicas, whether or not they hold a
  gradient here (replicas are the same tensors everywhere, though a rank may
  lack one's gradient; what a rank declared its own, e.g. its experts, may
  legitimately differ, so it is left out). Ranks whose fingerprints differ
  all raise.
  Steps without a norm (``unscale_``, the fused check) fingerprint only that
  fact: their decision does not depend on declarations.
  A scaler's step adds its skip policies to either (``loss_scaling``,
  ``spike``, ``max_consecutive_skips``): every rank takes its verdict from
  the same reduced vector, so ranks with different policies would take
  different verdicts (one steps, one skips) and all raise instead.

[Note: per-tensor norms without overflow]
For p = 1 and p = 2 a tensor's norm is one read, accumulated in float32
(float64 for float64 gradients) by the stats kernels. A float64 2-norm
overflows its sum of squares only above ~1.3e154; on the CPU the plain read
is taken and only a non-finite result is read again, normalised as below
(on an accelerator, where choosing would be a host sync, every float64
tensor is normalised). A float32 sum of
squares overflows only when one tensor's *scaled* 2-norm exceeds ~1.8e19
(an unscaled norm above ~2.8e14 at scale 2^16); such a tensor reads as
non-finite, so the step is skipped and the scale backs off until it fits,
never stepping on a wrong norm. For every other p, |g|^p overflows for
ordinary values (p = 8 at scale 2^16 already does), so each tensor is first
divided by its own max|g|: n_t = a_t·‖g_t/a_t‖_p, exact for any p at the
cost of a second read of those gradients. p = inf is max|g|.
Kernels that set ``overflow_safe_norms = True`` (the Triton kernels, which
normalise per block inside their one read) are called once instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from shardscale.core.step._errors import (
    raise_pending_errors,
)

if TYPE_CHECKING:
    pass
from shardscale.core.step._check import check
from shardscale.core.step._collect_stage import collect, owners_of
from shardscale.core.step._decide import PendingStep, apply
from shardscale.core.step._read import read, tensor_norms
from shardscale.core.step._reduce import reduce, result_device
from shardscale.core.step._types import StepConfig, StepRequest, StepResult

__all__ = ["read_tensor_norm", "run_step"]


def read_tensor_norm(tensor: torch.Tensor, norm_type: float, config: StepConfig) -> torch.Tensor:
    """One tensor's p-norm as the engine reads it (overflow-safe, 0-dim, no host sync).

    Used by ``StreamingStats`` to read a gradient in its post-accumulate-grad
    hook; :func:`run_step` then uses the value instead of reading the tensor.
    """
    kernels = config.registry.kernels_for(tensor.device, config.kernels)
    return tensor_norms(kernels, [tensor], norm_type)[0]


def run_step(items: Iterable[torch.Tensor], config: StepConfig, request: StepRequest) -> StepResult:
    """Collect, check, read, reduce once, decide and apply (see [Note: one step, top to bottom]).

    ``items`` are parameters (their ``.grad`` is used), or gradients with
    ``request.as_grads``; ``config`` says where the step reduces and with which
    plugins; ``request`` (:class:`StepRequest`) what it is asked for. A lazy
    request returns with the all-reduce issued and the decision pending in
    :meth:`StepResult.wait` (:class:`PendingStep`).

    Every rank of ``config.group`` must call this the same number of times
    with the same ``apply``/``norm_type``: it joins one all-reduce.
    """
    items = list(items)
    raise_pending_errors(wait=True)
    with torch.no_grad():
        local = collect(items, config, request)
        check(local, items, config, request)
        device = result_device(request.scale, local.buckets, items, as_grads=request.as_grads)
        reading = read(local, request, device=device)
        result, handle = reduce(local, reading, config, request, device=device)
        result.owners = owners_of(local)
        pending = PendingStep(result=result, handle=handle, local=local, request=request)
        if request.lazy:
            result._pending = pending
            return result
        pending.complete()
        if request.nonfinite_error is not None and bool(result.found_inf):
            raise request.nonfinite_error
        if local.error is None and not result.failed_now():
            apply(local, result, request, inv_scale=reading.inv_scale)
    return result
