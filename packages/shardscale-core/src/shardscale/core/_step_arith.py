"""The step vector's device arithmetic in few ops: this rank's slots in, the decision out.

[Note: the step's fixed cost]
Every device op of a step is a kernel launch on a GPU (~5 us of host time
each) and a dispatch on the CPU, whatever the model's size, so the vector's
bookkeeping is written to a budget (``test_step_op_budget``), stage by stage:

* **fill** (two ops): this rank's values are computed as 0-dim tensors,
  stacked once and put with one out-of-place ``index_put`` into a cached
  vector that already holds this rank's constant ``status`` (and, for a
  finite p, the floor of its ``peak``), at indices cached per layout;
* **flags and reason** (three ops): every flag of the decision is a
  comparison of the reduced vector with a cached *expected* vector (0 for
  counts, this rank's own ``status`` for the status block), so one ``ne``,
  one weighted product and one ``amax`` give the step's
  :class:`~shardscale.core._verdict.SkipReason` (:func:`reason_into`);
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

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardscale.core._step_vector import VectorLayout

__all__ = [
    "TINY64",
    "Probe",
    "constant",
    "fill_local",
    "fresh_outputs",
    "global_norm",
    "probe",
    "reason_into",
]

#: The smallest positive float64: clamping a non-negative peak to it changes only a zero peak
#: (whose tensors are all zero, so dividing them by it still gives 0).
TINY64 = math.ulp(0.0)

_F64 = torch.float64


@functools.lru_cache(maxsize=64)
def constant(value: float, device: torch.device) -> torch.Tensor:
    """A cached 0-dim float64 tensor on ``device`` (never written)."""
    return torch.tensor(value, dtype=_F64).to(device)


@functools.lru_cache(maxsize=64)
def _index(slots: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64).to(device)


@functools.lru_cache(maxsize=8)
def _base(
    size: int, constants: tuple[tuple[int, float], ...], device: torch.device
) -> torch.Tensor:
    # Never written: fill_local's index_put is out of place.
    vec = torch.zeros(size, dtype=_F64)
    for at, value in constants:
        vec[at] = value
    return vec.to(device)


def fill_local(
    layout: VectorLayout,
    rank: int,
    device: torch.device,
    *,
    slots: dict[str, torch.Tensor],
    shared: dict[str, torch.Tensor],
    status: float,
    peak_floor: bool = False,
) -> torch.Tensor:
    """A new vector with this rank's ``slots``, its ``status`` and its ``shared`` values set.

    Values are 0-dim tensors on ``device`` (any real or bool dtype: the stack
    promotes them to float64); slots left out stay 0, but with ``peak_floor``
    this rank's ``peak`` is at least :data:`TINY64` (a finite-p norm divides
    by the largest peak: see :func:`global_norm`). Two ops.
    """
    constants = [(layout.slot("status", rank), status)]
    if peak_floor:
        constants.append((layout.slot("peak", rank), TINY64))
    base = _base(layout.size, tuple(constants), device)
    index = [layout.slot(name, rank) for name in slots] + [layout.shared(n) for n in shared]
    if not index:
        return base.clone()
    values = torch.stack([*slots.values(), *shared.values()])
    if values.dtype is not _F64:  # only flags (bool): no float64 value to promote them
        values = values.to(_F64)
    return torch.index_put(base, (_index(tuple(index), device),), values)


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


@functools.lru_cache(maxsize=8)
def probe(
    world: int, status: float, weights: tuple[tuple[str, int], ...], device: torch.device
) -> Probe:
    """The cached :class:`Probe` of a ``world``-rank layout for a rank whose own status is
    ``status`` (-1 when it failed), with ``weights`` (block or shared name, reason; ``"spike"``
    for the spike flag)."""
    layout = VectorLayout(world)
    expected = torch.zeros(layout.size, dtype=_F64)
    expected[layout.block("status")] = status
    weight = torch.zeros(layout.size + 1, dtype=torch.int64)
    for name, reason in weights:
        if name == "spike":
            weight[layout.size] = reason
        elif name in layout.SHARED:
            weight[layout.shared(name)] = reason
        else:
            weight[layout.block(name)] = reason
    flags = torch.zeros(layout.size + 1, dtype=torch.bool, device=device)
    return Probe(
        expected=expected.to(device),
        weights=weight.to(device),
        flags=flags,
        vector_flags=flags[: layout.size],
        nan=flags[layout.shared("nan")],
        spike=flags[layout.size],
    )


def reason_into(vec: torch.Tensor, found: Probe, *, out: torch.Tensor | None) -> torch.Tensor:
    """The largest weight of a set flag (the step's reason), into ``out`` if given: three ops.

    The spike flag (:attr:`Probe.spike`) must be written first when it is weighted.
    """
    torch.ne(vec, found.expected, out=found.vector_flags)
    weighted = found.flags * found.weights
    return torch.amax(weighted, dim=0) if out is None else torch.amax(weighted, dim=0, out=out)


def global_norm(
    vec: torch.Tensor, layout: VectorLayout, p: float, *, scale: torch.Tensor | None
) -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
    """The global p-norm (float64, finite, unscaled by ``scale``) and the vector's blocks.

    ``M·(Σ_r S_r (M_r/M)^p)^(1/p)`` with ``M = max_r M_r`` (see [Note: the
    reduced vector] in ``_step_engine``). For a finite p every rank's peak slot
    is at least :data:`TINY64` (``fill_local(peak_floor=True)``), so ``M > 0``
    and nothing is clamped here; all-zero gradients still give 0 (every
    ``S_r`` is 0). The blocks are the per-rank blocks, in ``PER_RANK`` order,
    from the one ``split`` that also gives the norm its operands.
    """
    blocks = torch.split(vec, layout.world)
    peaks = blocks[layout.PER_RANK.index("peak")]
    top = peaks.amax()
    if math.isinf(p):
        value = top
    else:
        sums = blocks[layout.PER_RANK.index("scaled_sum")]
        ratio = peaks / top
        powered = ratio * ratio if p == 2.0 else ratio.pow(p)
        total = torch.dot(sums, powered)
        value = top * (total.sqrt() if p == 2.0 else total.pow(1.0 / p))
    if scale is not None:
        value = value / scale  # float64 / float32 0-dim: in float64
    return value, blocks[: len(layout.PER_RANK)]


@functools.lru_cache(maxsize=16)
def _template(device: torch.device) -> torch.Tensor:
    # found_inf, skip, coef: what a step that decided nothing would hold.
    return torch.tensor([0.0, 0.0, 1.0], dtype=torch.float32).to(device)


def fresh_outputs(device: torch.device) -> tuple[torch.Tensor, ...]:
    """New 0-dim float32 ``found_inf`` (0), ``skip`` (0) and ``coef`` (1): two ops."""
    return _template(device).clone().unbind()
