"""The step vector's device arithmetic in few ops: this rank's slots in, the decision out.

[Note: the step's fixed cost]
Every device op of a step is a kernel launch on a GPU (~5 us of host time
each) and a dispatch on the CPU, whatever the model's size, so the vector's
bookkeeping is written to a budget (``test_step_op_budget``), stage by stage:

* **fill** (one op): this rank's values are written by the ops that compute
  them (``out=``) into a cached scratch (:class:`LocalValues`), put with one
  out-of-place ``index_put`` into a cached vector that already holds this
  rank's constant ``status`` (and, for a finite p, the floor of its
  ``peak``), at indices cached per layout;
* **flags and reason** (three ops): every flag of the decision is a
  comparison of the reduced vector with a cached *expected* vector (0 for
  counts, this rank's own ``status`` for the status block), so one ``ne``,
  one weighted product and one ``amax`` give the step's
  :class:`~shardscale.core.step._verdict.SkipReason` (:func:`reason_into`);
* **norm** (a few ops, :func:`global_norm`): the blocks are views of one
  ``split``; no clamp is needed because every rank's peak slot is floored;
* **outputs**: the float32 results (``found_inf``, ``skip``, ``coef``) are
  views of one clone of a cached template, written with ``out=``.

Constants (the expected vectors, the indices, the weights, the templates)
live on the device, cached, so a warm step copies nothing from the host.
The scratch of the flags is reused by every step of a layout: nothing reads
it after the decision that wrote it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardscale.core.step._vector import VectorLayout

__all__ = [
    "StepScratch",
    "TINY64",
    "LocalValues",
    "Probe",
    "fill_local",
    "global_norm",
    "reason_into",
]

#: The smallest positive float64: clamping a non-negative peak to it changes only a zero peak
#: (whose tensors are all zero, so dividing them by it still gives 0).
TINY64 = math.ulp(0.0)

_F64 = torch.float64


@dataclass(frozen=True, slots=True)
class LocalValues:
    """Scratch for this rank's values: ops write their 0-dim results into :attr:`slots`
    (``out=``), and :func:`fill_local` puts :attr:`buffer` into the vector, so no stack is
    needed. Reused by every step with the same names: nothing reads it after the fill."""

    names: tuple[str, ...]
    #: float64, one value per name, in order.
    buffer: torch.Tensor
    #: name -> a 0-dim view of :attr:`buffer`.
    slots: dict[str, torch.Tensor]


def fill_local(
    scratch: StepScratch,
    layout: VectorLayout,
    rank: int,
    values: LocalValues,
    *,
    status: float,
    peak_floor: bool = False,
) -> torch.Tensor:
    """A new vector with this rank's ``values``, its ``status`` and, with ``peak_floor``, a
    ``peak`` of at least :data:`TINY64` where the values hold none (a finite-p norm divides by
    the largest peak: see :func:`global_norm`); everything else stays 0. One op.
    """
    device = values.buffer.device
    constants = [(layout.slot("status", rank), status)]
    if peak_floor:
        constants.append((layout.slot("peak", rank), TINY64))
    base = scratch.base(layout.size, tuple(constants), device)
    if not values.names:
        return base.clone()
    index = tuple(
        layout.slot(n, rank) if n in layout.PER_RANK else layout.shared(n) for n in values.names
    )
    return torch.index_put(base, (scratch.index(index, device),), values.buffer)


@dataclass(frozen=True, slots=True)
class Probe:
    """What the reduced vector is compared with, and the scratch the comparison writes.

    A flag is set where the reduced vector differs from :attr:`expected`: a
    count (``nonfinite``, ``nan``, ``loss_nonfinite``) that is not 0, or a
    rank's ``status`` that is not this rank's own. Ranks agree on every flag
    that matters: a rank failed or ranks disagree exactly when some status
    differs from this rank's, or this rank failed (its expected status is then
    -1, which no status equals); see [Note: the step's fixed cost].
    """

    #: float64, the vector's size: 0 but the status block (this rank's status, or -1).
    expected: torch.Tensor
    #: int64, the vector's size + 1: each flag's SkipReason (0: not a reason); the last is the
    #: spike flag's.
    weights: torch.Tensor
    #: bool scratch, the vector's size + 1: the flags, then the spike flag.
    flags: torch.Tensor
    #: Views of :attr:`flags`: the vector's part, the shared ``nan`` flag and the spike flag.
    vector_flags: torch.Tensor
    nan: torch.Tensor
    spike: torch.Tensor
    #: Views of :attr:`flags` after the spike flag: one per third-party skip policy, in order
    #: (weighted by precedence; see [Note: a skip policy] in ``_policy``).
    policy_flags: tuple[torch.Tensor, ...] = ()


def _new_probe(
    layout: VectorLayout, status: float, weights: tuple[tuple[str, int], ...], device: torch.device
) -> Probe:
    """The cached :class:`Probe` of ``layout`` for a rank whose own status is ``status`` (-1
    when it failed), with ``weights`` (block or shared name, reason; ``"spike"`` for the spike
    flag, ``"policy:<i>"`` for the i-th third-party policy's flag). A policy's own slots are
    no flags (weight 0): its flag is computed from them."""
    size, extra = layout.size, sum(name.startswith("policy:") for name, _ in weights)
    expected = torch.zeros(size, dtype=_F64)
    expected[layout.block("status")] = status
    weight = torch.zeros(size + 1 + extra, dtype=torch.int64)
    for name, reason in weights:
        if name == "spike":
            weight[size] = reason
        elif name.startswith("policy:"):
            weight[size + 1 + int(name[7:])] = reason
        elif name in layout.SHARED:
            weight[layout.shared(name)] = reason
        else:
            weight[layout.block(name)] = reason
    flags = torch.zeros(size + 1 + extra, dtype=torch.bool, device=device)
    return Probe(
        expected=expected.to(device),
        weights=weight.to(device),
        flags=flags,
        vector_flags=flags[:size],
        nan=flags[layout.shared("nan")],
        spike=flags[size],
        policy_flags=tuple(flags[size + 1 + i] for i in range(extra)),
    )


def reason_into(vec: torch.Tensor, found: Probe, *, out: torch.Tensor | None) -> torch.Tensor:
    """The largest weight of a set flag (the step's reason), into ``out`` if given: three ops.

    The spike flag (:attr:`Probe.spike`) must be written first when it is weighted.
    """
    torch.ne(vec, found.expected, out=found.vector_flags)
    weighted = found.flags * found.weights
    return torch.amax(weighted, dim=0) if out is None else torch.amax(weighted, dim=0, out=out)


def global_norm(
    vec: torch.Tensor,
    layout: VectorLayout,
    p: float,
    *,
    scale: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
    """The global p-norm (finite, unscaled by ``scale``) and the vector's blocks.

    Computed in float64; the last op writes into ``out`` (its dtype: no cast
    op of its own) when given, else the value is float64.

    ``M·(Σ_r S_r (M_r/M)^p)^(1/p)`` with ``M = max_r M_r`` (see [Note: the
    reduced vector] in ``_step_engine``). For a finite p every rank's peak slot
    is at least :data:`TINY64` (``fill_local(peak_floor=True)``), so ``M > 0``
    and nothing is clamped here; all-zero gradients still give 0 (every
    ``S_r`` is 0). The blocks are the per-rank blocks, in ``PER_RANK`` order,
    from the one ``split`` that also gives the norm its operands.
    """
    blocks = torch.split(vec, layout.world)
    per_rank = blocks[: len(layout.PER_RANK)]
    peaks = blocks[layout.PER_RANK.index("peak")]
    top = peaks.amax()
    root = None
    if not math.isinf(p):
        sums = blocks[layout.PER_RANK.index("scaled_sum")]
        ratio = peaks / top
        powered = ratio * ratio if p == 2.0 else ratio.pow(p)
        total = torch.dot(sums, powered)
        root = total.sqrt() if p == 2.0 else total.pow(1.0 / p)
    if root is not None and scale is not None:
        root = top * root
    elif root is None and scale is None:  # p = inf, nothing to unscale: no op left to write
        return (top if out is None else out.copy_(top)), per_rank
    # float64 * or / a float32 0-dim tensor: computed in float64, cast into ``out``.
    left = top if root is None else root
    if scale is not None:
        value = torch.div(left, scale) if out is None else torch.div(left, scale, out=out)
    else:
        value = torch.mul(top, left) if out is None else torch.mul(top, left, out=out)
    return value, per_rank


class StepScratch:
    """The device constants and scratch of the steps of one owner (see [Note: whose scratch]).

    [Note: whose scratch]
    Every tensor a step caches -- constants (the expected vector, the
    indices, the weights, 0-dim numbers, the output template) and scratch it
    writes (:class:`LocalValues`, :class:`Probe`'s flags) -- lives on a
    ``StepScratch``, never in a module: two trainings in two threads of one
    process, or ranks run as threads (torch's threaded process group), must
    each see only their own numbers. A step plan holds one per thread that
    steps it (:meth:`~shardscale.core.step._plan.StepPlan.scratch`), so a warm
    step copies nothing from the host; a cold step whose plan is not built
    yet uses a fresh one. Each cache is keyed on everything its value is made
    from (the values, the layout, the device).
    """

    __slots__ = ("_bases", "_constants", "_indices", "_locals", "_probes", "_templates")

    def __init__(self) -> None:
        self._constants: dict[tuple[object, torch.device, torch.dtype], torch.Tensor] = {}
        self._indices: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}
        self._bases: dict[
            tuple[int, tuple[tuple[int, float], ...], torch.device], torch.Tensor
        ] = {}
        self._locals: dict[tuple[tuple[str, ...], torch.device], LocalValues] = {}
        self._probes: dict[
            tuple[VectorLayout, float, tuple[tuple[str, int], ...], torch.device], Probe
        ] = {}
        self._templates: dict[torch.device, torch.Tensor] = {}

    def constant(
        self, value: float, device: torch.device, dtype: torch.dtype = _F64
    ) -> torch.Tensor:
        """A 0-dim tensor on ``device``, float64 unless ``dtype`` says (never written)."""
        # nan != nan: every nan shares one entry (a float key would add one per call).
        key: tuple[object, torch.device, torch.dtype] = (
            (value if not math.isnan(value) else "nan"),
            device,
            dtype,
        )
        hit = self._constants.get(key)
        if hit is None:
            hit = self._constants[key] = torch.tensor(value, dtype=dtype).to(device)
        return hit

    def index(self, slots: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """``slots`` as an int64 tensor on ``device`` (never written)."""
        key = (slots, device)
        hit = self._indices.get(key)
        if hit is None:
            hit = self._indices[key] = torch.tensor(slots, dtype=torch.int64).to(device)
        return hit

    def base(
        self, size: int, constants: tuple[tuple[int, float], ...], device: torch.device
    ) -> torch.Tensor:
        """A float64 vector of ``size`` zeros but ``constants`` (never written: filled out of
        place by :func:`fill_local`)."""
        key = (size, constants, device)
        hit = self._bases.get(key)
        if hit is None:
            vec = torch.zeros(size, dtype=_F64)
            for at, value in constants:
                vec[at] = value
            hit = self._bases[key] = vec.to(device)
        return hit

    def local_values(self, names: tuple[str, ...], device: torch.device) -> LocalValues:
        """The :class:`LocalValues` scratch for ``names`` (``PER_RANK`` or ``SHARED`` names)."""
        key = (names, device)
        hit = self._locals.get(key)
        if hit is None:
            buffer = torch.zeros(len(names), dtype=_F64, device=device)
            hit = LocalValues(names, buffer, dict(zip(names, buffer.unbind(), strict=True)))
            self._locals[key] = hit
        return hit

    def probe(
        self,
        layout: VectorLayout | int,
        status: float,
        weights: tuple[tuple[str, int], ...],
        device: torch.device,
    ) -> Probe:
        """The :class:`Probe` of ``layout`` (or a world size's) for a rank whose own status is
        ``status`` (-1 when it failed), with ``weights`` (see :func:`_new_probe`)."""
        if isinstance(layout, int):
            layout = VectorLayout(layout)
        key = (layout, status, weights, device)
        hit = self._probes.get(key)
        if hit is None:
            if len(self._probes) >= _MAX_PROBES:  # statuses change with declarations: bounded
                self._probes.pop(next(iter(self._probes)))
            hit = self._probes[key] = _new_probe(layout, status, weights, device)
        return hit

    def fresh_outputs(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """New 0-dim float32 ``found_inf`` (0), ``skip`` (0), ``coef`` (1) and a norm to write
        (:func:`global_norm`'s ``out``): two ops."""
        template = self._templates.get(device)
        if template is None:
            template = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float32).to(device)
            self._templates[device] = template
        return template.clone().unbind()


#: Probes one scratch keeps (a rank's status differs per declarations and chain).
_MAX_PROBES = 8
