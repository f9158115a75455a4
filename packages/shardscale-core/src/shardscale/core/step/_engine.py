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

import enum
import functools
import itertools
import math
import operator
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from shardscale.core.step._aliasing import check_no_aliased_grads
from shardscale.core.step._contract import ALL_RANKS, check_max_norm, check_norm_type
from shardscale.core._errors import DeclarationError
from shardscale.core.step._collect import GradBuckets, OwnerRefs, Trace, collect_grads
from shardscale.core._plain_adapter import PlainTensorAdapter
from shardscale.core._protocols import AdapterContext, CollectiveBackend, Handle, ReduceOp
from shardscale.core.step._arith import (
    TINY64,
    constant,
    fill_local,
    fresh_outputs,
    global_norm,
    local_values,
    probe,
    reason_into,
)
from shardscale.core.step._errors import (
    ErrorBlocks,
    GradientDeviceError,
    StepError,
    add_pending,
    chain_names,
    drop_pending,
    error_code,
    fingerprint,
    poll_errors,
    raise_pending_errors,
    raise_step_errors,
    verify_same_chain,
)
from shardscale.core.step._plan import (
    StepPlan,
    build_plan,
    find_plan,
    remember_plan,
    replicas_unchanged,
    warm_buckets,
)
from shardscale.core.step._vector import VectorLayout, pack_status
from shardscale.core.step._verdict import SkipReason, Verdict

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from shardscale.core._registry import Registry

__all__ = [
    "EPS",
    "Apply",
    "GradientDeviceError",
    "PrecomputedNorms",
    "StepConfig",
    "StepError",
    "StepRequest",
    "StepResult",
    "poll_errors",
    "read_tensor_norm",
    "run_step",
]

#: Added to the norm before dividing, as torch's clip_grad_norm_ does.
EPS = 1e-6


class Apply(enum.Enum):
    """What the step does to the gradients after the decision."""

    #: Read only (``get_total_norm``; the overflow check before a fused optimizer).
    NOTHING = "nothing"
    #: ``scaler.unscale_``: torch's unscale-and-check kernel, one read+write, before the reduce.
    UNSCALE = "unscale"
    #: Multiply every local gradient by ``coef`` (and by 1/scale when a scale is given).
    MULTIPLY = "multiply"
    #: Write nothing: ``result.grad_scale = scale / coef`` is for a fused optimizer to divide by.
    FUSED = "fused"


@dataclass(frozen=True, slots=True, kw_only=True)
class StepConfig:
    """Where a step reduces and which plugins it uses; built once per scaler or clip call.

    ``backend`` and ``group`` carry the one all-reduce; ``registry`` supplies
    the adapters and kernels (``kernels`` names one, ``None`` picks the best
    per device); ``distinct_dims`` names mesh dims whose coordinates hold
    different parameters (pipeline stages, expert groups; ``"*"``: every rank
    holds its own plain tensors); ``distinct_params`` the ``id()`` of plain
    tensors this rank holds its own of while the other plain tensors are
    replicated (experts placed on this rank; see
    :func:`~shardscale.core.distinct_param_ids`). Each must be one of the
    step's tensors.
    """

    backend: CollectiveBackend
    registry: Registry
    group: ProcessGroup | None = None
    kernels: str | None = None
    distinct_dims: frozenset[str] = frozenset()
    distinct_params: frozenset[int] = frozenset()
    #: Check, beside the chain, that every rank uses the same backend chain before this step
    #: (a scaler asks once, on its first step: every rank's scaler reaches it together).
    verify_chain: bool = False

    def adapter_context(self) -> AdapterContext:
        """What adapters need to know about this step's reduction group."""
        return AdapterContext(
            group=self.group,
            distinct_dims=self.distinct_dims,
            distinct_params=self.distinct_params,
            rank=self.backend.rank(self.group),
            world_size=self.backend.world_size(self.group),
        )


class PrecomputedNorms(Protocol):
    """Per-tensor norms computed earlier (during backward, by ``StreamingStats``)."""

    norm_type: float

    def lookup(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The 0-dim norm of exactly this local tensor, or None if it was not seen."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRequest:
    """What one :func:`run_step` call asks for (its keyword arguments, documented there).

    ``norm_type`` and ``max_norm`` are as the caller passed them: the check
    stage validates them against the contract, so that a bad value on one
    rank reaches every rank.
    """

    apply: Apply
    norm_type: float | None = None
    max_norm: float = math.inf
    scale: torch.Tensor | None = None
    as_grads: bool = False
    precomputed: PrecomputedNorms | None = None
    scale_device_type: str | None = None
    defer_errors: bool = False
    unscale_by: torch.Tensor | None = None
    nonfinite_error: BaseException | None = None
    lazy: bool = False
    refusal: BaseException | None = None
    verdict: Verdict | None = None
    loss_nonfinite: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # The caller's own contract with the engine: a programming error, raised at once.
        if self.apply in (Apply.UNSCALE, Apply.FUSED) and self.scale is None:
            raise ValueError(f"Apply.{self.apply.name} needs the scale the gradients carry")
        if self.lazy and (self.norm_type is not None or self.apply not in _LAZY_APPLY):
            raise ValueError("lazy=True is for steps that apply nothing after the decision")


_LAZY_APPLY = (Apply.UNSCALE, Apply.NOTHING)


@dataclass(slots=True, eq=False)
class StepResult:
    """What one step decided, identical on every rank (all tensors 0-dim, on ``device``).

    ``found_inf`` is 1.0 when any rank held a non-finite gradient (0.0 otherwise),
    the float32 flag torch's optimizers and scalers use. ``norm`` is the global
    norm (unscaled when a scale was given; float64 when any counted gradient is
    float64, else float32), inf or nan when ``found_inf``; ``None`` when no norm
    was asked for. ``coef`` is the clip coefficient applied (1 when nothing was
    clipped); ``grad_scale`` (``Apply.FUSED``) what a fused optimizer divides by.
    """

    found_inf: torch.Tensor
    norm: torch.Tensor | None
    coef: torch.Tensor
    grad_scale: torch.Tensor | None
    device: torch.device
    #: The reduced vector (see [Note: the reduced vector]); read it only on demand.
    vector: torch.Tensor
    world_size: int
    #: (parameter, local tensor) of every local gradient read, for overflow localisation.
    owners: Collection[tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]] = field(
        default_factory=list
    )
    #: Per local tensor (same order as ``owners``): True where it was finite; None if unknown.
    finite: torch.Tensor | None = None
    rank: int = 0
    #: This rank's own error, raised by :meth:`raise_errors` (after the collective).
    local_error: BaseException | None = None
    #: The backend chain's names and the group, for a chain-mismatch message.
    chain: str = ""
    group: Any = None
    #: What this rank declared (see [Note: declarations]), for a mismatch message.
    declarations: str = ""
    #: The step's verdict (see [Note: the verdict] in ``_verdict``): 1.0 when the optimizer
    #: must not step (float32, what fused optimizers test), and the ``SkipReason`` (int64).
    skip: torch.Tensor | None = None
    skip_reason: torch.Tensor | None = None
    #: The reduced vector's per-rank ``nonfinite`` block, when the decision already made the view.
    nonfinite_block: torch.Tensor | None = None
    #: Where the decision writes a float32 norm (one of the step's fresh outputs).
    _norm32: torch.Tensor | None = None
    _errors: ErrorBlocks | None = None
    _raised: bool = False
    _complete: Callable[[], None] | None = None

    @property
    def layout(self) -> VectorLayout:
        """The names of :attr:`vector`'s blocks."""
        return VectorLayout(self.world_size)

    def wait(self) -> StepResult:
        """Finish a ``lazy`` step: wait for the all-reduce and decide (a no-op otherwise)."""
        complete, self._complete = self._complete, None
        if complete is not None:
            complete()
        return self

    @property
    def errors_arrived(self) -> bool:
        """Whether the error blocks are readable on the host without waiting."""
        return self._errors is None or self._errors.arrived()

    def failed_now(self) -> bool:
        """Whether a failure is already known on the host (always answered off the GPU)."""
        if self.local_error is not None:
            return True
        if self._errors is None or self._errors.on_device:
            return False
        return bool(self._errors.read_failed(wait=False))

    def raise_errors(self, *, wait: bool = True) -> None:
        """Raise on every rank if any rank of the step failed or ranks disagree; else a no-op.

        See [Note: errors that reach every rank] in ``_step_errors``. Off the
        GPU the answer is at hand. On a GPU ``wait`` waits for the error
        blocks' copy, else an unfinished copy stays pending and is looked at
        by the next step or ``update()`` (never a host sync).
        """
        if self._raised:
            return
        errors = self._errors
        flagged = errors.read_failed(wait=wait) if errors is not None else None
        if flagged is None and self.local_error is None:
            return  # still on its way: stays pending
        drop_pending(self)
        # The W-slot block is read only when something failed (see ErrorBlocks).
        failed = errors is not None and bool(flagged)
        blocks = errors.read(wait=True) if failed and errors is not None else None
        try:
            raise_step_errors(
                blocks,
                rank=self.rank,
                local_error=self.local_error,
                chain=self.chain,
                group=self.group,
                declarations=self.declarations,
            )
        except BaseException:
            self._raised = True
            raise

    def nonfinite_ranks(self) -> tuple[int, ...]:
        """Group ranks that held a non-finite gradient (a host read of the vector)."""
        counts = self.vector[self.layout.block("nonfinite")].cpu()
        return tuple(int(r) for r in torch.nonzero(counts > 0).flatten())


def read_tensor_norm(tensor: torch.Tensor, norm_type: float, config: StepConfig) -> torch.Tensor:
    """One tensor's p-norm as the engine reads it (overflow-safe, 0-dim, no host sync).

    Used by ``StreamingStats`` to read a gradient in its post-accumulate-grad
    hook; :func:`run_step` then uses the value instead of reading the tensor.
    """
    kernels = config.registry.kernels_for(tensor.device, config.kernels)
    return _tensor_norms(kernels, [tensor], norm_type)[0]


# -- the step ------------------------------------------------------------------------------------


def run_step(
    items: Iterable[torch.Tensor],
    config: StepConfig,
    *,
    apply: Apply,
    norm_type: float | None = None,
    max_norm: float = math.inf,
    scale: torch.Tensor | None = None,
    as_grads: bool = False,
    precomputed: PrecomputedNorms | None = None,
    scale_device_type: str | None = None,
    defer_errors: bool = False,
    unscale_by: torch.Tensor | None = None,
    nonfinite_error: BaseException | None = None,
    lazy: bool = False,
    refusal: BaseException | None = None,
    verdict: Verdict | None = None,
    loss_nonfinite: torch.Tensor | None = None,
) -> StepResult:
    """Collect, check, read, reduce once, decide and apply (see [Note: one step, top to bottom]).

    Args:
        items: parameters (their ``.grad`` is used), or gradients with ``as_grads``.
        config: backend, group, registry, kernels and declarations.
        apply: what to do with the gradients after the decision (:class:`Apply`).
        norm_type: the p of the norm (any p > 0 or inf); ``None`` for no norm.
        max_norm: clip limit (> 0); ``inf`` clips nothing.
        scale: the loss scale the gradients still carry (``None``: not scaled).
            Results then live on its device, else on the first gradient's.
        precomputed: per-tensor norms already read (``StreamingStats``).
        scale_device_type: the scaler's device type, for error messages.
        defer_errors: return instead of raising when a rank failed, so the
            caller can record what happened first; it must then call
            :meth:`StepResult.raise_errors`.
        nonfinite_error: raise this on every rank, before anything is
            applied, when any rank holds a non-finite gradient (a host read:
            ``error_if_nonfinite`` of the clip functions).
        lazy: only issue the all-reduce; the decision is made when the
            result's :meth:`StepResult.wait` is first called. For steps that
            apply nothing afterwards (the scaler's ``unscale_`` and fused
            check), so that a middleware like ``coalescing`` can merge the
            reductions of several optimizers into one collective.
        unscale_by: with ``Apply.UNSCALE``, the factor to multiply by instead
            of 1/scale (torch's private ``_unscale_grads_`` takes one).
        refusal: an error the caller found before the step (a declaration
            that does not fit); recorded by the check stage like its own, so
            it reaches every rank and nothing changes.
        verdict: the scaler's skip policies (spike window, which reason a
            non-finite gradient gives); ``result.skip``/``skip_reason`` hold
            the verdict (see [Note: the verdict] in ``_verdict``).
        loss_nonfinite: 0-dim, nonzero when this rank observed a non-finite
            loss; carried in the vector so that every rank skips.

    Every rank of ``config.group`` must call this the same number of times
    with the same ``apply``/``norm_type``: it joins one all-reduce.
    """
    request = StepRequest(
        apply=apply,
        norm_type=norm_type,
        max_norm=max_norm,
        scale=scale,
        as_grads=as_grads,
        precomputed=precomputed,
        scale_device_type=scale_device_type,
        defer_errors=defer_errors,
        unscale_by=unscale_by,
        nonfinite_error=nonfinite_error,
        lazy=lazy,
        refusal=refusal,
        verdict=verdict,
        loss_nonfinite=loss_nonfinite,
    )
    items = list(items)
    raise_pending_errors(wait=True)
    with torch.no_grad():
        local = _collect(items, config, request)
        _check(local, items, config, request)
        device = _result_device(request.scale, local.buckets, items, as_grads=request.as_grads)
        # Only the unscale kernel and the multiply need 1/scale; the decision divides by it.
        needs_inv = request.apply in (Apply.UNSCALE, Apply.MULTIPLY)
        inv_scale = _inv_scale(request) if needs_inv else None
        reading = _read(local, request, inv_scale=inv_scale, device=device)
        result, handle = _reduce(
            local,
            reading,
            config,
            device=device,
            loss_nonfinite=request.loss_nonfinite,
            lazy=request.lazy,
        )
        result.owners = _owners(local)

        def complete() -> None:
            _wait(handle)
            _decide(result, local, request)
            if not request.defer_errors:
                result.raise_errors(wait=False)

        if request.lazy:
            result._complete = complete
            return result
        complete()
        if request.nonfinite_error is not None and bool(result.found_inf):
            raise request.nonfinite_error
        if local.error is None and not result.failed_now():
            _apply(local, result, request, inv_scale=inv_scale)
    return result


# -- 1. collect ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Local:
    """This rank's part of a step, filled by the collect and check stages."""

    buckets: GradBuckets
    rank: int
    world: int
    error: BaseException | None = None
    #: The step's options as the contract read them (harmless values after a refusal).
    norm_type: float | None = None
    max_norm: float = math.inf
    #: The stats kernels of each device holding a local gradient.
    kernels: dict[torch.device, Any] = field(default_factory=dict)
    #: What this rank declared (see [Note: declarations]).
    declarations: str = ""
    #: The step plan in use (see [Note: the step plan]); ``warm``: the buckets came from it.
    plan: StepPlan | None = None
    warm: bool = False
    #: A cold step's key, catalog and trace, to build a plan from once the checks pass.
    seed: tuple[Any, object, Trace] | None = None

    def record(self, exc: BaseException) -> None:
        """Keep the first error; the step goes on with nothing to read."""
        if self.error is None:
            self.error = exc
            self.buckets = GradBuckets()

    @property
    def code(self) -> int:
        """The error code this rank writes (0: none)."""
        return 0 if self.error is None else error_code(self.error)


def _collect(items: list[torch.Tensor], config: StepConfig, request: StepRequest) -> _Local:
    local = _Local(
        buckets=GradBuckets(),
        rank=config.backend.rank(config.group),
        world=config.backend.world_size(config.group),
    )
    try:
        group_ranks = _group_ranks(config)
        key = (
            request.as_grads,
            id(config.group),
            group_ranks,
            local.rank,
            local.world,
            config.distinct_dims,
            config.distinct_params,
        )
        catalog = config.registry.catalog_token()
        plan = find_plan(items, key, catalog)
        if plan is not None:
            warm = warm_buckets(plan, items, as_grads=request.as_grads)
            if warm is not None:
                local.buckets, local.plan, local.warm = warm, plan, True
                return local
        trace = Trace()
        local.buckets = collect_grads(
            # A norm must see coalesced sparse values; the scaler, like torch's, coalesces fp16 only.
            _coalesced(items, as_grads=request.as_grads)
            if request.norm_type is not None
            else items,
            config.adapter_context(),
            config.registry,
            group_ranks=group_ranks,
            as_grads=request.as_grads,
            trace=trace,
        )
        local.seed = (key, catalog, trace)
    except Exception as exc:
        local.record(exc)
    return local


def _owners(local: _Local) -> OwnerRefs:
    """(parameter, local tensor) weak references in bucket order, for overflow localisation."""
    tensors = itertools.chain.from_iterable(local.buckets.every.values())
    if local.plan is not None and local.error is None:  # warm, or built from these buckets
        return OwnerRefs(local.plan.owner_refs, list(map(weakref.ref, tensors)))
    return OwnerRefs.of(local.buckets.params(), tensors)


def _group_ranks(config: StepConfig) -> tuple[int, ...] | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return config.backend.group_ranks(config.group)


def _coalesced(items: list[torch.Tensor], *, as_grads: bool) -> list[torch.Tensor]:
    # A norm over uncoalesced sparse values counts duplicate indices separately.
    try:
        grads = items if as_grads else list(map(_GRAD, items))
        present = filter(functools.partial(operator.is_not, None), grads)  # C-level, no genexpr
        if not any(map(operator.attrgetter("is_sparse"), present)):
            return items  # the common case: nothing sparse, nothing to copy
    except AttributeError:
        pass  # not tensors: collect_grads names the problem
    out = []
    for item in items:
        grad = item if as_grads else getattr(item, "grad", None)
        if isinstance(grad, torch.Tensor) and grad.is_sparse and not grad.is_coalesced():
            if as_grads:
                out.append(grad.coalesce())  # the caller's tensor is only read: a copy will do
                continue
            item.grad = grad.coalesce()  # as torch's GradScaler does for fp16 sparse grads
        out.append(item)
    return out


# -- 2. check ------------------------------------------------------------------------------------


def _check(
    local: _Local, items: list[torch.Tensor], config: StepConfig, request: StepRequest
) -> None:
    """Record (never raise) anything that makes this rank's part of the step wrong."""
    if local.error is not None:
        return
    try:
        if request.refusal is not None:
            raise request.refusal
        # The contract's checks: a rank that alone got a bad value still joins the all-reduce.
        local.norm_type = (
            check_norm_type(request.norm_type) if request.norm_type is not None else None
        )
        local.max_norm = check_max_norm(request.max_norm)
        _check_devices(local.buckets, request.scale, request.scale_device_type)
        if not local.warm:  # a plan's parameters and declarations passed these when it was built
            _check_distinct_dims(local.buckets, config.distinct_dims)
            _check_distinct_params(local.buckets, items, config.distinct_params)
        if not request.as_grads:  # parameters: the step or the optimizer writes their .grad
            check_no_aliased_grads(local.buckets)
        # Resolved here, not while reading: an unknown or unsupported kernels name is refused
        # before the unscale kernel writes anything.
        local.kernels = {
            dev: config.registry.kernels_for(dev, config.kernels) for dev in local.buckets.devices()
        }
        if local.seed is not None:
            key, catalog, trace = local.seed
            local.plan = build_plan(
                items, local.buckets, trace, key=key, catalog=catalog, as_grads=request.as_grads
            )
        local.declarations = _declarations(local, items, config, request.verdict)
    except Exception as exc:
        local.record(exc)
        return
    if local.seed is not None and local.plan is not None:
        remember_plan(items, local.plan)  # every check passed: the next step may reuse it


def _check_devices(buckets: GradBuckets, scale: torch.Tensor | None, expect: str | None) -> None:
    for device in buckets.devices():
        if device.type == "meta":
            raise GradientDeviceError(
                "a gradient is on the meta device, which holds no values to check or scale; "
                "move the parameters to a real device (model.to_empty(device=...), then "
                "initialise them) before training"
            )
        if scale is not None and device.type not in (scale.device.type, "cpu"):
            raise GradientDeviceError(
                f"a gradient is on {device}, but this scaler was built for {expect!r} and its "
                f"scale lives on {scale.device}; move the parameters to {scale.device.type}, or "
                f"build the scaler with device={device.type!r} and scale a loss on that device"
            )


_PLAIN = PlainTensorAdapter()
_GRAD = operator.attrgetter("grad")


def _check_distinct_dims(buckets: GradBuckets, distinct: frozenset[str]) -> None:
    names = distinct - {ALL_RANKS}
    if not names:
        return
    known: set[str] = set()
    seen_mesh = False
    plain = 0
    for param in buckets.params():
        mesh = getattr(param, "device_mesh", None)
        if mesh is None:
            plain += _PLAIN.claims(param)
            continue
        seen_mesh = True
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        for m in (mesh, root):
            known.update(n for n in (m.mesh_dim_names or ()) if n)
    if not seen_mesh and plain:
        # A mesh dim name cannot describe a plain tensor: it would be ignored, and every plain
        # tensor counted as a replica (only rank 0's pipeline stage, say).
        raise DeclarationError(
            f"distinct_dims names {sorted(names)}, but the {plain} parameter(s) of this step "
            "with a gradient are plain tensors, which have no device mesh for a mesh dim name "
            "to describe (it would be ignored and each plain tensor counted as a replica). "
            "Declare plain tensors instead: distinct_dims=('*',) when every rank holds its own "
            "(pipeline stages), or distinct_params=[...] with the tensors this rank holds its "
            "own of (experts) while the others are replicated"
        )
    if seen_mesh and not names <= known:
        raise DeclarationError(
            f"distinct_dims names {sorted(names - known)}, which no mesh of these parameters "
            f"has (their mesh dims: {sorted(known) or 'unnamed'}); name the mesh dims "
            "(init_device_mesh(..., mesh_dim_names=...)) and pass those names, or '*' for "
            "plain tensors held differently on every rank"
        )


def _check_distinct_params(
    buckets: GradBuckets, items: Sequence[torch.Tensor], distinct: frozenset[int]
) -> None:
    if not distinct:
        return
    strangers = len(distinct - {id(item) for item in items})
    if strangers:
        # Matched by id(): a tensor that is not one of the step's would be ignored silently.
        raise DeclarationError(
            f"distinct_params holds {strangers} tensor(s) that are not among the "
            f"{len(items)} tensors of this step (the optimizer's parameters, or those passed "
            "to the clip call), so they would be ignored. Declare the tensors the optimizer "
            "holds: after fully_shard/.to()/copying the model, pass the new parameters "
            "(e.g. list(model.experts.parameters()) taken after the model is ready)"
        )
    for param in buckets.params():
        if id(param) in distinct and type(param) not in (torch.Tensor, torch.nn.Parameter):
            raise ValueError(
                f"distinct_params holds a {type(param).__name__} parameter of shape "
                f"{tuple(param.shape)}; it is for plain tensors only. A DTensor already says "
                "which ranks hold which part through its mesh: put the mesh dim whose "
                "coordinates hold different parameters in distinct_dims instead"
            )


def _declarations(
    local: _Local, items: Sequence[torch.Tensor], config: StepConfig, verdict: Verdict | None
) -> str:
    """What must agree across the ranks of this step (see [Note: declarations])."""
    # The scaler's skip policies decide on the same reduced vector everywhere: they must agree.
    policies = f", {verdict.declared}" if verdict is not None and verdict.declared else ""
    if local.norm_type is None:
        return "no norm" + policies
    if local.world <= 1:
        return "one rank"  # nothing to agree with; spares the walk below
    plan = local.plan
    if plan is not None and plan.replica_listing is not None and replicas_unchanged(plan, items):
        listing = plan.replica_listing  # the same tensors, shapes and dtypes as last time
    else:
        positions = _replica_positions(items, config)
        listing = _replica_listing(items, positions)
        if plan is not None:
            plan.remember_replicas(items, positions, listing)
    return (
        f"distinct_dims={sorted(config.distinct_dims)}, norm_type={local.norm_type}, "
        f"max_norm={local.max_norm}, replicated plain tensors [{listing}]{policies}"
    )


def _replica_positions(items: Sequence[torch.Tensor], config: StepConfig) -> list[int]:
    """Where the plain tensors that are replicas on every rank sit among the step's tensors."""
    if ALL_RANKS in config.distinct_dims:
        return []
    distinct = config.distinct_params
    kinds = list(map(type, items))
    never = {kind for kind in set(kinds) if _PLAIN.claims_type(kind) is False}
    if len(never) == len(set(kinds)):
        return []  # no plain tensor at all (an FSDP2 model): no walk
    # The step's tensors, with a gradient or not: a replica may lack one on some rank.
    return [
        i
        for i, (item, kind) in enumerate(zip(items, kinds, strict=True))
        if kind not in never and id(item) not in distinct and _PLAIN.claims(item)
    ]


def _replica_listing(items: Sequence[torch.Tensor], positions: Sequence[int]) -> str:
    replicas: Counter[tuple[tuple[int, ...], torch.dtype]] = Counter(
        (tuple(items[i].shape), items[i].dtype) for i in positions
    )
    # Sorted: the multiset, not the order the parameters happen to be listed in.
    return ", ".join(
        sorted(
            f"{n} x {shape} {str(dtype).removeprefix('torch.')}"
            for (shape, dtype), n in replicas.items()
        )
    )


# -- 3. read -------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Reading:
    counted_norms: list[torch.Tensor] = field(default_factory=list)  # 1-D per bucket, any value
    every_norms: list[torch.Tensor] = field(default_factory=list)  # 1-D per bucket, owners order
    flags: list[torch.Tensor] = field(default_factory=list)  # unscale kernel's found_inf


def _inv_scale(request: StepRequest) -> torch.Tensor | None:
    if request.unscale_by is not None and request.apply is Apply.UNSCALE:
        return request.unscale_by.reshape(()).float()
    scale = request.scale
    return scale.double().reciprocal().float() if scale is not None else None


def _read(
    local: _Local,
    request: StepRequest,
    *,
    inv_scale: torch.Tensor | None,
    device: torch.device,
) -> _Reading:
    reading = _Reading()
    if local.error is not None:
        return reading
    p = local.norm_type
    for (dev, dtype), tensors in local.buckets.every.items():
        if not tensors:
            continue
        kernels = local.kernels[dev]
        if request.apply is Apply.UNSCALE:
            assert inv_scale is not None
            flag = torch.zeros((), dtype=torch.float32, device=dev)
            kernels.unscale_and_check_(tensors, flag, inv_scale.to(dev, non_blocking=True))
            reading.flags.append(flag.to(device, non_blocking=True))
            continue
        counts = local.buckets.counts_mask[(dev, dtype)]
        norms = _bucket_norms(kernels, tensors, counts, p, request.precomputed, device)
        reading.every_norms.append(norms)
        if all(counts):
            reading.counted_norms.append(norms)
        elif any(counts):
            picked = (
                local.plan.counted_index((dev, dtype), device)
                if local.warm and local.plan is not None
                else torch.tensor([i for i, c in enumerate(counts) if c], device=device)
            )
            reading.counted_norms.append(norms[picked])
    return reading


def _bucket_norms(
    kernels: Any,
    tensors: Sequence[torch.Tensor],
    counts: Sequence[bool],
    p: float | None,
    precomputed: PrecomputedNorms | None,
    device: torch.device,
) -> torch.Tensor:
    """One float64 entry per tensor of a bucket: counted tensors' p-norm, the others' max|g|.

    Vectors, not per-tensor scalars: with thousands of small FSDP shards the Python
    bookkeeping per tensor would cost more than the read.
    """
    reuse = [precomputed.lookup(t) for t in tensors] if precomputed is not None else None
    if reuse is None and (p is None or all(counts) or not any(counts)):
        # One kernel call for the bucket, without a Python step per tensor.
        q = p if (p is not None and counts and counts[0]) else math.inf
        return _tensor_norms(kernels, tensors, q).to(device=device, dtype=torch.float64)
    groups: dict[float, list[int]] = {}
    for i, c in enumerate(counts):
        if reuse is None or reuse[i] is None:
            groups.setdefault(p if (c and p is not None) else math.inf, []).append(i)
    if reuse is None and len(groups) == 1:  # the common case: one kernel call for the bucket
        ((q, _),) = groups.items()
        return _tensor_norms(kernels, tensors, q).to(device=device, dtype=torch.float64)
    out = torch.empty(len(tensors), dtype=torch.float64, device=device)
    for q, idx in groups.items():
        got = _tensor_norms(kernels, [tensors[i] for i in idx], q)
        out[torch.tensor(idx, device=device)] = got.to(device=device, dtype=torch.float64)
    if reuse is not None:
        seen = [i for i, r in enumerate(reuse) if r is not None]
        if seen:
            values = torch.stack([reuse[i].reshape(()).to(device, torch.float64) for i in seen])  # type: ignore[union-attr]
            out[torch.tensor(seen, device=device)] = values
    return out


def _tensor_norms(kernels: Any, tensors: Sequence[torch.Tensor], p: float) -> torch.Tensor:
    """Per-tensor p-norms, 1-D, overflow-safe (see [Note: per-tensor norms without overflow])."""
    if getattr(kernels, "overflow_safe_norms", False) is True:
        # The kernels normalise inside their one read (StatsKernels' optional attribute).
        safe: torch.Tensor = kernels.tensor_norms(tensors, p)
        return safe
    if p in (1.0, 2.0) or math.isinf(p):
        if p == 2.0 and tensors and tensors[0].dtype is torch.float64:  # one dtype per bucket
            if tensors[0].device.type == "cpu":
                return _float64_norms_on_cpu(kernels, tensors)
            return _normalised_norms(kernels, tensors, p)
        norms: torch.Tensor = kernels.tensor_norms(tensors, p)
        return norms
    return _normalised_norms(kernels, tensors, p)


def _float64_norms_on_cpu(kernels: Any, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """float64 2-norms in one read, normalising again only the tensors whose sum overflowed.

    A float64 sum of squares overflows only above a norm of ~1.3e154, so the plain read is
    almost always the answer; a non-finite one (an inf/nan element, or that overflow) is read
    again normalised. Deciding that reads the norms on the host, which costs nothing on the
    CPU; on an accelerator it would be a host sync, so there both reads are made.
    """
    norms: torch.Tensor = kernels.tensor_norms(tensors, 2.0)
    redo = [i for i, finite in enumerate(torch.isfinite(norms).tolist()) if not finite]
    if redo:
        again = _normalised_norms(kernels, [tensors[i] for i in redo], 2.0)
        norms[redo] = again.to(norms.dtype)
    return norms


def _normalised_norms(kernels: Any, tensors: Sequence[torch.Tensor], p: float) -> torch.Tensor:
    # a_t·‖g_t/a_t‖_p: every |element/a_t| ≤ 1, so no power can overflow (a second read).
    peaks: torch.Tensor = kernels.tensor_norms(tensors, math.inf)
    safe = torch.where((peaks > 0) & torch.isfinite(peaks), peaks, torch.ones_like(peaks))
    # Divide in the accumulation precision: a bf16 quotient would cost the norm 3 digits.
    scaled = [t.to(peaks.dtype) / s for t, s in zip(tensors, safe.unbind(), strict=True)]
    inner: torch.Tensor = kernels.tensor_norms(scaled, p)
    # Non-finite (or all-zero) tensors keep their peak, which already says so.
    ok = (peaks > 0) & torch.isfinite(peaks)
    return torch.where(ok, inner.to(peaks.dtype) * peaks, peaks)


# -- 4. reduce -----------------------------------------------------------------------------------


def _result_device(
    scale: torch.Tensor | None,
    buckets: GradBuckets,
    items: Sequence[torch.Tensor],
    *,
    as_grads: bool,
) -> torch.device:
    if scale is not None:
        return scale.device
    for device in buckets.devices():
        if device.type != "meta":
            return device
    for item in items:
        grad = item if as_grads else getattr(item, "grad", None)
        if isinstance(grad, torch.Tensor) and grad.device.type != "meta":
            return grad.device
        if isinstance(item, torch.Tensor) and item.device.type != "meta":
            return item.device
    return torch.device("cpu")


def _reduce(
    local: _Local,
    reading: _Reading,
    config: StepConfig,
    *,
    device: torch.device,
    loss_nonfinite: torch.Tensor | None = None,
    lazy: bool = False,
) -> tuple[StepResult, Handle]:
    """Fill this rank's slots of the vector and issue the step's one all-reduce."""
    if config.verify_chain:
        verify_same_chain(config.backend, config.group, device)
    chain = chain_names(config.backend)
    vec, finite = _local_vector(
        reading, local, device=device, chain=chain, loss_nonfinite=loss_nonfinite
    )
    handle = _issue(vec, config)
    found_inf, skip, coef, norm32 = fresh_outputs(device)
    result = StepResult(
        found_inf=found_inf,
        norm=None,
        coef=coef,
        grad_scale=None,
        device=device,
        vector=vec,
        world_size=local.world,
        rank=local.rank,
        local_error=local.error,
        chain=chain,
        group=config.group,
        declarations=local.declarations,
        finite=finite,
        # Filled by the decision; allocated now so that a lazy step's caller can hold them.
        skip=skip,
        skip_reason=torch.zeros((), dtype=torch.int64, device=device) if lazy else None,
        _norm32=norm32,
    )
    return result, handle


def _local_vector(
    reading: _Reading,
    local: _Local,
    *,
    device: torch.device,
    chain: str,
    loss_nonfinite: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's slots of the step's vector, and which local tensors read finite.

    Few device ops, whatever the bucket count (see [Note: the step's fixed cost] in
    ``_step_arith``): slots the step has nothing for stay 0.
    """
    p = local.norm_type
    norm = bool(reading.counted_norms) and p is not None
    names: tuple[str, ...] = ("peak",) if norm else ()
    if norm and p is not None and not math.isinf(p):
        names += ("scaled_sum",)
    if reading.every_norms or reading.flags:
        names += ("nonfinite",)
    if reading.every_norms:
        names += ("nan",)
    if loss_nonfinite is not None:
        names += ("loss_nonfinite",)
    values = local_values(names, device)
    out = values.slots
    if norm and p is not None:
        n = _joined(reading.counted_norms).nan_to_num(0.0, 0.0, 0.0)  # finite ones only
        torch.amax(n, dim=0, out=out["peak"])
        if not math.isinf(p):
            # The floored peak is written: the decision divides by the largest (global_norm).
            peak = out["peak"].clamp_(min=TINY64)
            ratio = n / peak
            if p == 2.0:
                torch.dot(ratio, ratio, out=out["scaled_sum"])
            else:
                torch.sum(ratio.pow(p), dim=0, out=out["scaled_sum"])
    finite = None
    if reading.every_norms:
        every = _joined(reading.every_norms)
        finite = torch.isfinite(every)
        torch.sum(~finite, dim=0, dtype=torch.float64, out=out["nonfinite"])
        torch.sum(every.isnan(), dim=0, dtype=torch.float64, out=out["nan"])
    if reading.flags:  # the unscale kernel's found_inf, one per bucket
        flags = reading.flags
        if len(flags) == 1 and not reading.every_norms:
            torch.gt(flags[0], 0, out=out["nonfinite"])
        else:
            seen = torch.stack(flags).gt(0).sum()
            if reading.every_norms:
                out["nonfinite"].add_(seen)
            else:
                out["nonfinite"].copy_(seen)
    if loss_nonfinite is not None:
        observed = loss_nonfinite if loss_nonfinite.dim() == 0 else loss_nonfinite.reshape(())
        if observed.device != device:
            observed = observed.to(device, non_blocking=True)
        torch.ne(observed, 0, out=out["loss_nonfinite"])
    floor = p is not None and not math.isinf(p)
    vec = fill_local(
        VectorLayout(local.world),
        local.rank,
        values,
        status=_status(local, chain),
        peak_floor=floor,
    )
    return vec, finite


def _status(local: _Local, chain: str) -> float:
    """This rank's packed ``status`` slot (see [Note: the reduced vector])."""
    return pack_status(local.code, fingerprint(chain), fingerprint(local.declarations))


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


_COLLECTIVE_NOTE = (
    "shardscale: this was the step's one all-reduce, which every rank of the reduction group "
    "joins once per scaler.unscale_/step or clip call; a rank that died, raised outside "
    "shardscale or skipped the call leaves the others failing here"
)


def _issue(vec: torch.Tensor, config: StepConfig) -> Handle:
    try:
        return config.backend.all_reduce(vec, op=ReduceOp.SUM, group=config.group)
    except Exception as exc:
        # A note, not a new exception: the backend's error type (and message) stays catchable.
        exc.add_note(_COLLECTIVE_NOTE)
        raise


def _wait(handle: Handle) -> None:
    try:
        handle.wait()
    except Exception as exc:
        exc.add_note(_COLLECTIVE_NOTE)
        raise


# -- 5. decide -----------------------------------------------------------------------------------


def _decide(result: StepResult, local: _Local, request: StepRequest) -> None:
    """found_inf, norm, coef, grad_scale and the verdict from the reduced vector, identical on
    every rank, in a fixed handful of device ops (see [Note: the step's fixed cost] in
    ``_step_arith``)."""
    vec, layout = result.vector, result.layout
    p, max_norm, scale, verdict = local.norm_type, local.max_norm, request.scale, request.verdict
    assert result.skip is not None
    spike = verdict.spike if verdict is not None and p is not None else None
    # -1 matches no status: a rank that failed sets the flag itself (see Probe).
    own = -1.0 if local.error is not None else _status(local, result.chain)
    found = probe(layout.world, own, _weights(verdict, spike=spike is not None), vec.device)
    # float64 when this rank reads float64 gradients, as torch; decided locally (no host read
    # of the vector), so ranks agree whenever they hold the same parameter dtypes.
    f64 = any(dtype is torch.float64 for _, dtype in local.buckets.every)
    value = None
    if p is not None:
        # In float64, written into a float32 output unless this rank reads float64 gradients.
        out = None if f64 else result._norm32
        value, blocks = global_norm(vec, layout, p, scale=scale, out=out)
        result.nonfinite_block = blocks[layout.PER_RANK.index("nonfinite")]
        if spike is not None:
            # Its flag is weighted in the reason: a spike skips unless a stronger reason does.
            spike.is_spike(value, out=found.spike)
    reason = reason_into(vec, found, out=result.skip_reason)
    result.skip_reason = reason
    result._errors = ErrorBlocks(vec, layout, reason, failed_at=int(SkipReason.ERROR))
    # A non-finite gradient, an error or a disagreement on any rank: nothing is stepped on.
    bad = reason >= int(SkipReason.NONFINITE)
    torch.ge(reason, int(SkipReason.NONFINITE), out=result.found_inf)
    if value is not None:
        # float32 constants: the result keeps the value's dtype.
        nan, inf = (constant(v, vec.device, torch.float32) for v in (math.nan, math.inf))
        result.norm = torch.where(bad, torch.where(found.nan, nan, inf), value)
        if not math.isinf(max_norm):
            # In float64 from the reported norm (float32 + float64 0-dim tensors: float64).
            clip = constant(max_norm, vec.device) / (result.norm + constant(EPS, vec.device))
            # As torch's clip_grad_norm_, a nan norm gives a nan coefficient (minimum keeps it).
            if scale is None:
                torch.minimum(clip, constant(1.0, vec.device), out=result.coef)
            else:
                # With a scaler an overflow step is skipped: leave the grads as unscale_ would
                # (found_inf is 1 then; fmax takes it over a coefficient of 0 or nan).
                clip = torch.minimum(clip, constant(1.0, vec.device))
                torch.fmax(clip, result.found_inf, out=result.coef)
    if request.apply is Apply.FUSED:
        assert scale is not None
        coef = result.coef if result.coef.device == scale.device else result.coef.to(scale.device)
        result.grad_scale = scale / coef
    torch.gt(reason, 0, out=result.skip)
    if result._errors.on_device:
        add_pending(result)


def _weights(verdict: Verdict | None, *, spike: bool) -> tuple[tuple[str, int], ...]:
    """What each flag of the reduced vector weighs in the reason (see ``_step_arith.Probe``)."""
    kind = verdict.nonfinite_reason if verdict is not None else SkipReason.NONFINITE
    weights = [("nonfinite", int(kind)), ("status", int(SkipReason.ERROR))]
    if verdict is not None:  # a clip call alone does not skip for a loss it never saw
        weights.append(("loss_nonfinite", int(SkipReason.LOSS)))
    if spike:
        weights.append(("spike", int(SkipReason.SPIKE)))
    return tuple(weights)


# -- 6. apply ------------------------------------------------------------------------------------


def _apply(
    local: _Local, result: StepResult, request: StepRequest, *, inv_scale: torch.Tensor | None
) -> None:
    if request.apply is not Apply.MULTIPLY:
        return
    if inv_scale is None and math.isinf(local.max_norm):
        return  # nothing to unscale, nothing to clip
    factor = result.coef if inv_scale is None else result.coef * inv_scale.to(result.coef.device)
    for (dev, _dtype), tensors in local.buckets.every.items():
        if tensors:
            local.kernels[dev].mul_(tensors, factor.to(dev, non_blocking=True))
