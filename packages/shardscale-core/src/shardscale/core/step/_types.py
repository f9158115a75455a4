"""The step engine's data: its options, its request, this rank's part and its result."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from shardscale.core._protocols import AdapterContext, CollectiveBackend
from shardscale.core.step._arith import StepScratch
from shardscale.core.step._buckets import GradBuckets, GradOwners, Trace
from shardscale.core.step._errors import (
    ErrorBlocks,
    drop_pending,
    error_code,
    raise_step_errors,
)
from shardscale.core.step._plan import StepPlan, StepPlans
from shardscale.core.step._vector import VectorLayout
from shardscale.core.step._verdict import Verdict

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from shardscale.core._registry import Registry
    from shardscale.core.step._decide import PendingStep

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
    :func:`~shardscale.core.step.distinct_param_ids`). Each must be one of the
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
    """What one :func:`run_step` call asks for: the engine's only carrier of a step's options.

    Attributes:
        apply: what to do with the gradients after the decision (:class:`Apply`).
        norm_type: the p of the norm (any p > 0 or inf); ``None`` for no norm.
        max_norm: clip limit (> 0); ``inf`` clips nothing.
        scale: the loss scale the gradients still carry (``None``: not scaled).
            Results then live on its device, else on the first gradient's.
        as_grads: the items are gradients, not parameters.
        precomputed: per-tensor norms already read (``StreamingStats``).
        scale_device_type: the scaler's device type, for error messages.
        defer_errors: return instead of raising when a rank failed, so the
            caller can record what happened first; it must then call
            :meth:`StepResult.raise_errors`.
        unscale_by: with ``Apply.UNSCALE``, the factor to multiply by instead
            of 1/scale (torch's private ``_unscale_grads_`` takes one).
        nonfinite_error: raise this on every rank, before anything is
            applied, when any rank holds a non-finite gradient (a host read:
            ``error_if_nonfinite`` of the clip functions).
        lazy: only issue the all-reduce; the decision is made when the
            result's :meth:`StepResult.wait` is first called. For steps that
            apply nothing afterwards (the scaler's ``unscale_`` and fused
            check), so that a middleware like ``coalescing`` can merge the
            reductions of several optimizers into one collective.
        refusal: an error the caller found before the step (a declaration
            that does not fit); recorded by the check stage like its own, so
            it reaches every rank and nothing changes.
        verdict: the scaler's skip policies; ``result.skip``/``skip_reason``
            hold the verdict (see [Note: the verdict] in ``_verdict``).
        loss_nonfinite: 0-dim, nonzero when this rank observed a non-finite
            loss; carried in the vector so that every rank skips.
        loss: 0-dim, the sum of the losses this rank observed in the iteration
            (for ``verdict.policies``), or None.
        plans: where the caller keeps the plans of the tensors it steps again
            (see [Note: the step plan] in ``_plan``); None runs the step cold
            and keeps nothing.

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
    loss: torch.Tensor | None = None
    plans: StepPlans | None = None

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
    owners: GradOwners = field(default_factory=lambda: GradOwners([], []))
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
    #: The shared slots the third-party skip policies added to :attr:`vector`.
    policy_slots: tuple[str, ...] = ()
    #: Where the decision writes a float32 norm (one of the step's fresh outputs).
    _norm32: torch.Tensor | None = None
    _errors: ErrorBlocks | None = None
    _raised: bool = False
    _pending: PendingStep | None = None

    @property
    def is_pending(self) -> bool:
        """Whether the decision still waits for :meth:`wait` (a lazy step)."""
        return self._pending is not None

    @property
    def layout(self) -> VectorLayout:
        """The names of :attr:`vector`'s blocks."""
        return VectorLayout(self.world_size, self.policy_slots)

    def wait(self) -> StepResult:
        """Finish a ``lazy`` step: wait for the all-reduce and decide (a no-op otherwise)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.complete()
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


@dataclass(slots=True)
class LocalStep:
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
    #: The scratch of a step without a plan (a cold step that failed its checks).
    own_scratch: StepScratch | None = None

    def scratch(self) -> StepScratch:
        """The plan's scratch for this thread, or one of the step's own (see [Note: whose
        scratch] in ``_arith``)."""
        if self.plan is not None:
            return self.plan.scratch()
        if self.own_scratch is None:
            self.own_scratch = StepScratch()
        return self.own_scratch

    def record(self, exc: BaseException) -> None:
        """Keep the first error; the step goes on with nothing to read."""
        if self.error is None:
            self.error = exc
            self.buckets = GradBuckets()

    @property
    def code(self) -> int:
        """The error code this rank writes (0: none)."""
        return 0 if self.error is None else error_code(self.error)
