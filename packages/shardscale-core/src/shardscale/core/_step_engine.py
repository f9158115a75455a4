"""The step engine: every rank reads, reduces and decides in one place.

[Note: one step, top to bottom]
Every caller that looks at gradients before an optimizer step --
``ShardedGradScaler.unscale_``/``step``, ``shardscale.clip``'s
``unscale_and_clip_``, ``clip_grad_norm_``, ``get_total_norm`` and
``StreamingStats`` -- is a thin caller of :func:`run_step`, which does, in
this order:

1. **collect**: each parameter's gradient is described by the adapter that
   claims it (local tensor, whether this rank's copy *counts* towards sums);
2. **check**: anything wrong on this rank (a layout no adapter can combine, a
   gradient on the meta device, an unknown ``distinct_dims`` name, ...) is
   *recorded*, never raised yet: peers are about to wait for this rank in the
   all-reduce, so it must join it;
3. **read**: each local gradient is read once. The non-finite flag covers
   *every* local gradient, counted or not (replicas drift, a rank may hold a
   gradient others lack); the norm's statistics cover only the counted ones;
4. **reduce**: ONE all-reduce (SUM) of a small float64 vector in which each
   rank fills its own slots (see [Note: the reduced vector]);
5. **decide**: an error anywhere makes every rank raise, naming the failing
   ranks; otherwise found_inf, the norm and the clip coefficient follow from
   the vector, identically on every rank;
6. **apply**: one in-place multiply, or nothing and a ``grad_scale`` for a
   fused optimizer.

[Note: the reduced vector]
With W ranks in the reduction group, rank r writes only slot r of each block
and zeros elsewhere, so the SUM all-reduce is exact (adding zeros) and every
rank receives every rank's numbers:

========  ===============================================================
block     rank r's slot
========  ===============================================================
M         max over its counted tensors of the tensor's p-norm (finite only)
S         Σ_t (n_t / M_r)^p over the same tensors, each term ≤ 1
nonfin    how many of its local gradients hold inf/nan
error     an error code (0: none; see ``_ERROR_KINDS``)
chain     a 24-bit fingerprint of its backend chain's names
========  ===============================================================

Ranks whose fingerprints differ raise together: they reached the same
collective through different middleware, which can mismatch and hang the
next time (a scaler also checks once, beside the chain, before its first
step, so a mismatch that would hang at once is caught too).

plus two shared counters: how many counted float64 gradients exist (the
norm is float64 if any rank has one, as in torch) and how many of the
non-finite gradients hold nan (the reported norm is nan then, else inf).
The global norm is M·(Σ_r S_r (M_r/M)^p)^(1/p) with M = max_r M_r: no
intermediate exceeds the norm itself, so the combination cannot overflow for
any p > 0. Its size is 5·W + 1 numbers: 40 KiB for 1024 ranks.

[Note: per-tensor norms without overflow]
For p = 1 and p = 2 a tensor's norm is one read, accumulated in float32
(float64 for float64 gradients) by the stats kernels. A float32 sum of
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
import math
import weakref
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from shardscale.core._aliasing import check_no_aliased_grads
from shardscale.core._contract import check_max_norm, check_norm_type
from shardscale.core._errors import LayoutError, ShardscaleError
from shardscale.core._gradients import GradBuckets, collect_grads
from shardscale.core._protocols import AdapterContext, CollectiveBackend, Handle, ReduceOp

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
    "StepResult",
    "poll_errors",
    "read_tensor_norm",
    "run_step",
]

#: Added to the norm before dividing, as torch's clip_grad_norm_ does.
EPS = 1e-6

# Error codes carried in the vector's error block: what peers can say about a failing rank.
_ERROR_KINDS: dict[int, str] = {
    1: "a gradient layout no installed adapter can combine (LayoutError)",
    2: "a gradient on a device this step cannot read (meta, or another accelerator)",
    3: "a gradient that is not real floating point",
    4: "a parameter no installed adapter claims",
    5: "bad arguments to the step (see that rank's error)",
    6: "an unexpected error while reading gradients",
}


class StepError(ShardscaleError):
    """Another rank (or ranks) failed inside a step that every rank joined.

    Raised on the ranks that were fine; the failing ranks raise their own
    error, with a note saying the others were told. ``ranks`` lists the
    failing ranks of the reduction group, ``kinds`` what each had.
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...], kinds: dict[int, str]) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.kinds = kinds


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
    replicated (experts placed on this rank; see :func:`distinct_param_ids`).
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
    owners: list[tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]] = field(
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
    _codes: torch.Tensor | None = None
    _event: Any = None
    _raised: bool = False
    _complete: Any = None

    def wait(self) -> StepResult:
        """Finish a ``lazy`` step: wait for the all-reduce and decide (a no-op otherwise)."""
        complete, self._complete = self._complete, None
        if complete is not None:
            complete()
        return self

    def _start_error_read(self) -> None:
        # The same path on every device, and never a device-to-host sync: the error block is
        # copied into host memory (pinned, asynchronous on a GPU) and read there with tolist().
        w = self.world_size
        block = self.vector[3 * w : 5 * w]  # error codes and chain fingerprints
        on_gpu = block.device.type == "cuda"
        self._codes = torch.empty(2 * w, dtype=block.dtype, pin_memory=on_gpu)
        self._codes.copy_(block, non_blocking=on_gpu)
        if on_gpu:
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
            _pending.append(self)

    def _codes_now(self, *, wait: bool) -> list[float] | None:
        if self._event is not None:
            if not wait and not self._event.query():
                return None
            self._event.synchronize()
        assert self._codes is not None
        codes: list[float] = self._codes.tolist()
        return codes

    def failed_now(self) -> bool:
        """Whether a failure is already known on the host (always answered off the GPU)."""
        if self.local_error is not None:
            return True
        codes = self._codes_now(wait=False) if self._event is None else None
        return bool(codes and any(codes[: self.world_size]))

    def raise_errors(self, *, wait: bool = True) -> None:
        """Raise on every rank if any rank of the step failed; a no-op otherwise.

        The failing rank raises its own error, with a note that its peers were
        told; the others raise :class:`StepError` naming the failing ranks and
        what each had. Off the GPU the answer is at hand. On a GPU the error
        block is copied to pinned host memory after the all-reduce; ``wait``
        waits for that copy, else an unfinished copy stays pending and is
        looked at by the next step or ``update()`` (never a host sync).
        """
        if self._raised:
            return
        codes = self._codes_now(wait=wait)
        if codes is None and self.local_error is None:
            return  # still on its way: stays in _pending
        if self in _pending:
            _pending.remove(self)
        w = self.world_size
        failing = tuple(r for r, code in enumerate((codes or [])[:w]) if code)
        prints = (codes or [])[w:]
        if prints and len(set(prints)) > 1 and self.local_error is None:
            self._raised = True
            _raise_chain_mismatch(self.chain, self.group, w)
        if self.local_error is None and not failing:
            return
        self._raised = True
        kinds = {r: _ERROR_KINDS.get(int((codes or [])[r]), "an error") for r in failing}
        if self.local_error is not None:
            others = [r for r in failing if r != self.rank]
            self.local_error.add_note(
                "shardscale: this rank still joined the step's all-reduce, so every rank of the "
                "reduction group raised too"
                + (f" (other failing ranks: {others})" if others else "")
            )
            raise self.local_error
        listing = "; ".join(f"rank {r}: {k}" for r, k in kinds.items())
        raise StepError(
            f"rank(s) {list(failing)} of the reduction group failed in this step ({listing}); "
            "this rank stops with them instead of waiting for a timeout. The failing rank's own "
            "error says what to fix.",
            ranks=failing,
            kinds=kinds,
        )

    def nonfinite_ranks(self) -> tuple[int, ...]:
        """Group ranks that held a non-finite gradient (a host read of the vector)."""
        w = self.world_size
        counts = self.vector[2 * w : 3 * w].cpu()
        return tuple(int(r) for r in torch.nonzero(counts > 0).flatten())


def read_tensor_norm(tensor: torch.Tensor, norm_type: float, config: StepConfig) -> torch.Tensor:
    """One tensor's p-norm as the engine reads it (overflow-safe, 0-dim, no host sync).

    Used by ``StreamingStats`` to read a gradient in its post-accumulate-grad
    hook; :func:`run_step` then uses the value instead of reading the tensor.
    """
    kernels = config.registry.kernels_for(tensor.device, config.kernels)
    return _tensor_norms(kernels, [tensor], norm_type)[0]


def _tensor_norms(kernels: Any, tensors: Sequence[torch.Tensor], p: float) -> torch.Tensor:
    """Per-tensor p-norms, 1-D, overflow-safe (see [Note: per-tensor norms without overflow])."""
    if getattr(kernels, "overflow_safe_norms", False) is True:
        # The kernels normalise inside their one read (StatsKernels' optional attribute).
        safe: torch.Tensor = kernels.tensor_norms(tensors, p)
        return safe
    if p in (1.0, 2.0) or math.isinf(p):
        if any(t.dtype is torch.float64 for t in tensors) and p == 2.0:
            return _normalised_norms(kernels, tensors, p)
        norms: torch.Tensor = kernels.tensor_norms(tensors, p)
        return norms
    return _normalised_norms(kernels, tensors, p)


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


# -- the backend-chain check ---------------------------------------------------------------------


def _fingerprint(chain: str) -> float:
    return float(zlib.crc32(chain.encode()) & 0xFFFFFF)  # exact in float32 and float64


def _chain_names(backend: CollectiveBackend) -> str:
    names = []
    node: Any = backend
    while node is not None:
        names.append(str(getattr(node, "name", type(node).__name__)))
        node = getattr(node, "inner", None)
    return "+".join(names)


def _verify_same_chain(config: StepConfig, device: torch.device) -> None:
    """Every rank must use the same backend chain: checked beside the chain.

    Different chains can issue different collectives and deadlock before the
    step's own fingerprint check could run, so this exchange goes straight
    through torch.distributed. Only when ``StepConfig.verify_chain`` asks.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    backend, group = config.backend, config.group
    world = backend.world_size(group)
    if world <= 1:
        return
    chain = _chain_names(backend)
    mine = _fingerprint(chain)
    vec = torch.zeros(world, dtype=torch.float64, device=device)
    vec[backend.rank(group)] = mine
    dist.all_reduce(vec, group=group)
    if all(v == mine for v in vec.tolist()):  # once per scaler: a host read is fine here
        return
    _raise_chain_mismatch(chain, group, world)


def _raise_chain_mismatch(chain: str, group: Any, world: int) -> None:
    import torch.distributed as dist

    chains: list[Any] = [None] * world
    dist.all_gather_object(chains, chain, group=group)
    listing = ", ".join(f"rank {r}: {c!r}" for r, c in enumerate(chains))
    raise ShardscaleError(
        f"ranks use different collective backend chains ({listing}); every rank of a step must "
        "use the same chain or their collectives can mismatch and hang. Set the same "
        "backend= (or $SHARDSCALE_BACKEND) on every rank."
    )


# -- collect and check ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Local:
    buckets: GradBuckets
    error: BaseException | None = None
    code: int = 0
    #: The step's options as the contract read them (harmless values after a refusal).
    norm_type: float | None = None
    max_norm: float = math.inf
    #: The stats kernels of each device holding a local gradient.
    kernels: dict[torch.device, Any] = field(default_factory=dict)


def _error_code(exc: BaseException) -> int:
    from shardscale.core._errors import PluginNotFoundError

    if isinstance(exc, LayoutError):
        return 1
    if isinstance(exc, GradientDeviceError):
        return 2
    if isinstance(exc, TypeError) and "floating point" in str(exc):
        return 3
    if isinstance(exc, PluginNotFoundError):
        return 4
    if isinstance(exc, (TypeError, ValueError)):
        return 5
    return 6


class GradientDeviceError(ShardscaleError, ValueError):
    """A gradient on a device the step cannot read (meta, or not the scale's device)."""


def _collect(
    items: Iterable[torch.Tensor],
    config: StepConfig,
    *,
    as_grads: bool,
    scale: torch.Tensor | None,
    expect_device: str | None,
    for_norm: bool,
    norm_type: object,
    max_norm: object,
) -> _Local:
    try:
        # The contract's checks, recorded like any other local error: a rank that alone got a
        # bad value still joins the all-reduce, and every rank raises, nothing changed.
        p = check_norm_type(norm_type) if norm_type is not None else None
        limit = check_max_norm(max_norm)
        buckets = collect_grads(
            # A norm must see coalesced sparse values; the scaler, like torch's, coalesces fp16 only.
            _coalesced(items, as_grads=as_grads) if for_norm else items,
            config.adapter_context(),
            config.registry,
            group_ranks=_group_ranks(config),
            as_grads=as_grads,
        )
        _check_devices(buckets, scale, expect_device)
        _check_distinct_dims(buckets, config.distinct_dims)
        _check_distinct_params(buckets, config.distinct_params)
        # Resolved here, not while reading: an unknown or unsupported kernels name is refused
        # before the unscale kernel writes anything, and reaches every rank like any error.
        kernels = {
            dev: config.registry.kernels_for(dev, config.kernels) for dev in buckets.devices()
        }
        if not as_grads:  # parameters: the step or the optimizer writes their .grad
            check_no_aliased_grads(buckets)
    except Exception as exc:
        return _Local(buckets=GradBuckets(), error=exc, code=_error_code(exc))
    return _Local(buckets=buckets, norm_type=p, max_norm=limit, kernels=kernels)


def _group_ranks(config: StepConfig) -> tuple[int, ...] | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return config.backend.group_ranks(config.group)


def _coalesced(items: Iterable[torch.Tensor], *, as_grads: bool) -> list[torch.Tensor]:
    # A norm over uncoalesced sparse values counts duplicate indices separately.
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


def _check_distinct_dims(buckets: GradBuckets, distinct: frozenset[str]) -> None:
    names = distinct - {"*"}
    if not names:
        return
    known: set[str] = set()
    seen_mesh = False
    for param in buckets.params():
        mesh = getattr(param, "device_mesh", None)
        if mesh is None:
            continue
        seen_mesh = True
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        for m in (mesh, root):
            known.update(n for n in (m.mesh_dim_names or ()) if n)
    if seen_mesh and not names <= known:
        raise ValueError(
            f"distinct_dims names {sorted(names - known)}, which no mesh of these parameters "
            f"has (their mesh dims: {sorted(known) or 'unnamed'}); name the mesh dims "
            "(init_device_mesh(..., mesh_dim_names=...)) and pass those names, or '*' for "
            "plain tensors held differently on every rank"
        )


def _check_distinct_params(buckets: GradBuckets, distinct: frozenset[int]) -> None:
    if not distinct:
        return
    for param in buckets.params():
        if id(param) in distinct and type(param) not in (torch.Tensor, torch.nn.Parameter):
            raise ValueError(
                f"distinct_params holds a {type(param).__name__} parameter of shape "
                f"{tuple(param.shape)}; it is for plain tensors only. A DTensor already says "
                "which ranks hold which part through its mesh: put the mesh dim whose "
                "coordinates hold different parameters in distinct_dims instead"
            )


# -- read ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Reading:
    counted_norms: list[torch.Tensor] = field(default_factory=list)  # 1-D per bucket, any value
    every_norms: list[torch.Tensor] = field(default_factory=list)  # 1-D per bucket, owners order
    flags: list[torch.Tensor] = field(default_factory=list)  # unscale kernel's found_inf


def _read(
    local: _Local,
    config: StepConfig,
    *,
    apply: Apply,
    p: float | None,
    inv_scale: torch.Tensor | None,
    precomputed: PrecomputedNorms | None,
    device: torch.device,
) -> _Reading:
    reading = _Reading()
    if local.error is not None:
        return reading
    for (dev, dtype), tensors in local.buckets.every.items():
        if not tensors:
            continue
        kernels = local.kernels[dev]
        if apply is Apply.UNSCALE:
            assert inv_scale is not None
            flag = torch.zeros((), dtype=torch.float32, device=dev)
            kernels.unscale_and_check_(tensors, flag, inv_scale.to(dev, non_blocking=True))
            reading.flags.append(flag.to(device, non_blocking=True))
            continue
        counts = local.buckets.counts_mask[(dev, dtype)]
        norms = _bucket_norms(kernels, tensors, counts, p, precomputed, device)
        reading.every_norms.append(norms)
        if all(counts):
            reading.counted_norms.append(norms)
        elif any(counts):
            picked = torch.tensor([i for i, c in enumerate(counts) if c], device=device)
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


# -- reduce and decide ---------------------------------------------------------------------------


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
) -> StepResult:
    """Collect, check, read, reduce once, decide and apply (see [Note: one step, top to bottom]).

    Args:
        items: parameters (their ``.grad`` is used), or gradients with ``as_grads``.
        config: backend, group, registry, kernels and distinct dims.
        apply: what to do with the gradients after the decision (:class:`Apply`).
        norm_type: the p of the norm (any p > 0 or inf); ``None`` for no norm.
        max_norm: clip limit; ``inf`` clips nothing.
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

    Every rank of ``config.group`` must call this the same number of times
    with the same ``apply``/``norm_type``: it joins one all-reduce.
    """
    if apply in (Apply.UNSCALE, Apply.FUSED) and scale is None:
        raise ValueError(f"Apply.{apply.name} needs the scale the gradients carry")
    items = list(items)
    _raise_pending_errors(wait=True)
    with torch.no_grad():
        local = _collect(
            items,
            config,
            as_grads=as_grads,
            scale=scale,
            expect_device=scale_device_type,
            for_norm=norm_type is not None,
            norm_type=norm_type,
            max_norm=max_norm,
        )
        norm_type, max_norm = local.norm_type, local.max_norm
        device = _result_device(scale, local.buckets, items, as_grads=as_grads)
        inv_scale = scale.double().reciprocal().float() if scale is not None else None
        if unscale_by is not None and apply is Apply.UNSCALE:
            inv_scale = unscale_by.reshape(()).float()
        reading = _read(
            local,
            config,
            apply=apply,
            p=norm_type,
            inv_scale=inv_scale,
            precomputed=precomputed,
            device=device,
        )
        if config.verify_chain:
            _verify_same_chain(config, device)
        world = config.backend.world_size(config.group)
        rank = config.backend.rank(config.group)
        chain = _chain_names(config.backend)
        vec, finite = _local_vector(
            reading,
            local,
            p=norm_type,
            rank=rank,
            world=world,
            device=device,
            fingerprint=_fingerprint(chain),
        )
        handle = _issue(vec, config)
        result = StepResult(
            found_inf=torch.zeros((), dtype=torch.float32, device=device),
            norm=None,
            coef=torch.ones((), dtype=torch.float32, device=device),
            grad_scale=None,
            device=device,
            vector=vec,
            world_size=world,
            rank=rank,
            local_error=local.error,
            chain=chain,
            group=config.group,
            finite=finite,
        )
        result.owners = [
            (weakref.ref(param), weakref.ref(t)) for param, t in local.buckets.owner_pairs()
        ]

        def complete() -> None:
            _wait(handle)
            decided = _decide(
                vec,
                world=world,
                p=norm_type,
                max_norm=max_norm,
                scale=scale,
                inv_scale=inv_scale,
                apply=apply,
                device=device,
                f64=any(dtype is torch.float64 for _, dtype in local.buckets.every),
            )
            result.found_inf.copy_(decided.found_inf)
            result.norm, result.coef, result.grad_scale = (
                decided.norm,
                decided.coef,
                decided.grad_scale,
            )
            result._start_error_read()
            if not defer_errors:
                result.raise_errors(wait=False)

        if lazy:
            if norm_type is not None or apply not in (Apply.UNSCALE, Apply.NOTHING):
                raise ValueError("lazy=True is for steps that apply nothing after the decision")
            result._complete = complete
            return result
        complete()
        if nonfinite_error is not None and bool(result.found_inf):
            raise nonfinite_error
        if local.error is None and not result.failed_now():
            _apply(local.buckets, result, apply, config, max_norm=max_norm, inv_scale=inv_scale)
    return result


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


def _local_vector(
    reading: _Reading,
    local: _Local,
    *,
    p: float | None,
    rank: int,
    world: int,
    device: torch.device,
    fingerprint: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's slots of the step's vector, and which local tensors read finite."""
    vec = torch.zeros(5 * world + 1, dtype=torch.float64, device=device)
    if reading.counted_norms and p is not None:
        n = torch.cat(reading.counted_norms)
        n = torch.where(torch.isfinite(n), n, torch.zeros_like(n))
        peak = n.max()
        vec[rank] = peak
        if not math.isinf(p):
            ratio = n / torch.where(peak > 0, peak, torch.ones_like(peak))
            vec[world + rank] = ratio.pow(p).sum()
    nonfinite = torch.zeros((), dtype=torch.float64, device=device)
    nan = torch.zeros((), dtype=torch.float64, device=device)
    finite = None
    if reading.every_norms:
        every = torch.cat(reading.every_norms)
        finite = torch.isfinite(every)
        nonfinite = nonfinite + (~finite).sum()
        nan = nan + torch.isnan(every).sum()
    for flag in reading.flags:
        nonfinite = nonfinite + (flag > 0).to(torch.float64)
    vec[2 * world + rank] = nonfinite
    vec[3 * world + rank] = float(local.code)
    vec[4 * world + rank] = fingerprint
    vec[5 * world] = nan
    return vec, finite


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


def _decide(
    vec: torch.Tensor,
    *,
    world: int,
    p: float | None,
    max_norm: float,
    scale: torch.Tensor | None,
    inv_scale: torch.Tensor | None,
    apply: Apply,
    device: torch.device,
    f64: bool,
) -> StepResult:
    w = world
    bad = vec[2 * w : 4 * w].sum() > 0  # a non-finite gradient or an error, on any rank
    found_inf = bad.to(torch.float32)
    norm = None
    coef = torch.ones((), dtype=torch.float32, device=device)
    if p is not None:
        peaks = vec[:w]
        top = peaks.max()
        if math.isinf(p):
            value = top
        else:
            safe_top = torch.where(top > 0, top, torch.ones_like(top))
            total = (vec[w : 2 * w] * (peaks / safe_top).pow(p)).sum()
            value = top * total.pow(1.0 / p)
        if inv_scale is not None:
            value = value * inv_scale.to(torch.float64)
        # float64 when this rank reads float64 gradients, as torch; decided locally (no host
        # read of the vector), so ranks agree whenever they hold the same parameter dtypes.
        dtype = torch.float64 if f64 else torch.float32
        nonfinite = torch.where(vec[5 * w] > 0, math.nan, math.inf).to(value.dtype)
        norm = torch.where(bad, nonfinite, value).to(dtype)
        if not math.isinf(max_norm):
            clip = (max_norm / (norm.to(torch.float64) + EPS)).clamp(max=1.0)
            if scale is not None:
                # With a scaler an overflow step is skipped: leave the grads as unscale_ would.
                clip = torch.where(bad, torch.ones_like(clip), clip)
            coef = clip.to(torch.float32)
    grad_scale = None
    if apply is Apply.FUSED:
        assert scale is not None
        grad_scale = scale / coef.to(scale.device)
    return StepResult(
        found_inf=found_inf,
        norm=norm,
        coef=coef,
        grad_scale=grad_scale,
        device=device,
        vector=vec,
        world_size=w,
    )


# -- apply ---------------------------------------------------------------------------------------


def _apply(
    buckets: GradBuckets,
    result: StepResult,
    apply: Apply,
    config: StepConfig,
    *,
    max_norm: float,
    inv_scale: torch.Tensor | None,
) -> None:
    if apply is not Apply.MULTIPLY:
        return
    if inv_scale is None and math.isinf(max_norm):
        return  # nothing to unscale, nothing to clip
    factor = result.coef if inv_scale is None else result.coef * inv_scale.to(result.coef.device)
    for (dev, _dtype), tensors in buckets.every.items():
        if tensors:
            kernels = config.registry.kernels_for(dev, config.kernels)
            kernels.mul_(tensors, factor.to(dev, non_blocking=True))


# -- errors that reach every rank ----------------------------------------------------------------

#: Accelerator steps whose error block is still being copied to the host.
_pending: list[StepResult] = []


def _raise_pending_errors(*, wait: bool) -> None:
    """Raise a failure recorded by an earlier accelerator step (see ``StepResult.raise_errors``)."""
    while _pending:
        result = _pending[0]
        if not wait and result._event is not None and not result._event.query():
            return
        _pending.pop(0)
        result.raise_errors(wait=True)


def poll_errors() -> None:
    """Raise now if an earlier step on an accelerator recorded an error and its copy arrived.

    Never waits: called by ``ShardedGradScaler.update()`` so that a failure on
    another rank surfaces within the iteration without a host sync.
    """
    _raise_pending_errors(wait=False)
