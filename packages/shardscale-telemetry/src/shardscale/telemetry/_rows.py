"""Step records (device tensors) turned into plain rows, many at once, in one host read.

[Note: one host read per flush]
A :class:`~shardscale.core.StepRecord` holds 0-dim tensors on the scaler's
device; reading any of them on the host waits for the device (on a GPU, a
stream synchronisation). Observers therefore never read a record when it
arrives: they keep it, and :func:`read_rows` turns a whole buffer into rows by
stacking each field's tensors on the device and reading one flat float64
tensor with a single ``tolist()``. float64 holds every value exactly: the
float32 scale, the int32 trackers, counts, and a float32 or float64 norm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shardscale.core import SkipReason

if TYPE_CHECKING:
    from shardscale.core import StepRecord

__all__ = ["StepRow", "read_rows", "reason_code", "reason_name"]


@dataclass(frozen=True, slots=True)
class StepRow:
    """One scaler iteration as Python values: what every observer writes.

    ``scale``, ``growth_tracker`` and ``hysteresis_tracker`` are the values
    after the iteration's ``update()`` (``scale`` is what ``get_scale()``
    returned then, the scale the next iteration multiplies its loss by).
    ``grad_norm`` is the global gradient norm when ``unscale_and_clip_`` ran
    (inf or nan on a skipped step), else ``None``. ``overflow_ranks`` are the
    ranks of the scaler's process group that held non-finite gradients, with
    ``overflow_counts[i]`` such gradients on ``overflow_ranks[i]`` (both empty
    on a clean step). ``skip_reason`` is why a skipped step was skipped, the
    lower-case name of its :class:`~shardscale.core.SkipReason` (``"overflow"``,
    ``"spike"``, ...; see docs/skipped-steps.md), ``None`` on a step taken or
    when the scaler reports no reason. ``rank`` is the global rank that wrote
    the row and ``time`` the wall-clock time (seconds since the epoch) its
    ``update()`` finished.
    """

    step: int
    rank: int
    time: float
    scale: float
    skipped: bool
    grad_norm: float | None
    growth_tracker: int
    hysteresis_tracker: int | None
    overflow_ranks: tuple[int, ...] = ()
    overflow_counts: tuple[int, ...] = field(default=())
    skip_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A dict for strict JSON: a non-finite ``grad_norm`` becomes ``None`` (``null``)."""
        norm = self.grad_norm
        return {
            "step": self.step,
            "rank": self.rank,
            "time": self.time,
            "scale": self.scale,
            "skipped": self.skipped,
            "grad_norm": norm if norm is not None and math.isfinite(norm) else None,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
            "overflow_ranks": list(self.overflow_ranks),
            "overflow_counts": list(self.overflow_counts),
            "skip_reason": self.skip_reason,
        }


# The 0-dim fields read for every record, in this order; optional ones may be None.
_SCALARS = ("scale", "skipped", "growth_tracker", "hysteresis_tracker", "grad_norm", "skip_reason")


def reason_name(code: float | None) -> str | None:
    """The lower-case :class:`~shardscale.core.SkipReason` name of ``code``; ``None`` for none.

    A code this version of core does not know is kept as ``"reason <code>"``
    rather than dropped (a row must never fail to be written).
    """
    if code is None or code == 0:
        return None
    try:
        return SkipReason(int(code)).name.lower()
    except ValueError:
        return f"reason {int(code)}"


def reason_code(name: str | None) -> int:
    """The inverse of :func:`reason_name`: the enum value for TensorBoard and W&B (0: none)."""
    if name is None:
        return 0
    if name.startswith("reason "):
        return int(name.split()[1])
    return int(SkipReason[name.upper()].value)


def read_rows(records: Sequence[StepRecord], *, rank: int, times: Sequence[float]) -> list[StepRow]:
    """Turn ``records`` into rows with one device-to-host read per device (see the note).

    ``times[i]`` is the wall-clock time ``records[i]`` arrived.
    """
    if not records:
        return []
    # (field, record index) -> position in the flat read of its device
    pieces: dict[torch.device, list[torch.Tensor]] = {}
    where: dict[tuple[str, int], tuple[torch.device, int, int]] = {}
    offsets: dict[torch.device, int] = {}

    def add(dev: torch.device, tensor: torch.Tensor, keys: list[tuple[str, int]]) -> None:
        start = offsets.get(dev, 0)
        pieces.setdefault(dev, []).append(tensor)
        for j, key in enumerate(keys):
            where[key] = (dev, start + j, 1)
        offsets[dev] = start + tensor.numel()

    for name in _SCALARS:
        present = [(i, t) for i, r in enumerate(records) if (t := getattr(r, name)) is not None]
        by_dev: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for i, t in present:
            by_dev.setdefault(t.device, []).append((i, t))
        for dev, items in by_dev.items():
            # One stack per field and device (stack promotes mixed dtypes, e.g. norms).
            stacked = torch.stack([t.reshape(()) for _, t in items]).to(torch.float64)
            add(dev, stacked, [(name, i) for i, _ in items])
    for i, r in enumerate(records):
        counts = r.nonfinite_per_rank
        if counts is not None and counts.numel():
            dev = counts.device
            start = offsets.get(dev, 0)
            pieces.setdefault(dev, []).append(counts.reshape(-1).to(torch.float64))
            where[("nonfinite", i)] = (dev, start, counts.numel())
            offsets[dev] = start + counts.numel()
    # The one read per device: everything above was device work.
    flat = {dev: torch.cat(ts).tolist() for dev, ts in pieces.items()}

    def value(name: str, i: int) -> float | None:
        loc = where.get((name, i))
        if loc is None:
            return None
        dev, pos, _ = loc
        v: float = flat[dev][pos]
        return v

    rows = []
    for i, r in enumerate(records):
        ranks: tuple[int, ...] = ()
        counts_out: tuple[int, ...] = ()
        loc = where.get(("nonfinite", i))
        if loc is not None:
            dev, pos, n = loc
            per_rank = flat[dev][pos : pos + n]
            ranks = tuple(k for k, c in enumerate(per_rank) if c > 0)
            counts_out = tuple(int(per_rank[k]) for k in ranks)
        scale = value("scale", i)
        skipped = value("skipped", i)
        growth = value("growth_tracker", i)
        hyst = value("hysteresis_tracker", i)
        assert scale is not None and skipped is not None and growth is not None
        rows.append(
            StepRow(
                step=r.step,
                rank=rank,
                time=times[i],
                scale=scale,
                skipped=skipped > 0,
                grad_norm=value("grad_norm", i),
                growth_tracker=int(growth),
                hysteresis_tracker=None if hyst is None else int(hyst),
                overflow_ranks=ranks,
                overflow_counts=counts_out,
                # Only a skipped step has a reason (a taken step's code is NONE, 0).
                skip_reason=reason_name(value("skip_reason", i)) if skipped > 0 else None,
            )
        )
    return rows
