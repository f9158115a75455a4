"""Medians and 95 % bootstrap intervals of the ratio of two arms' medians.

[Note: intervals]
Each round of the benchmark runs every arm once (in a balanced order), so the
samples of two arms are paired by round. The interval resamples *rounds* with
replacement (a paired bootstrap: a slow moment of the machine stays in both
arms of its round), computes median(arm) / median(reference) for each
resample, and takes the 2.5 and 97.5 percentiles. The generator has a fixed
seed, so the same samples always give the same interval. A ratio is called
faster or slower only when its interval excludes 1 *and* it rests on at
least :data:`MIN_VERDICT_SAMPLES` (10) paired samples (rounds).

[Note: too few rounds for a verdict]
With n rounds the resampled median takes few distinct values (n = 4: the
mean of two of four samples), so the percentile interval is far narrower
than its nominal 95 %: a smoke run of 4 rounds once called torch against
itself (the A/A row) "faster", 0.84 [0.72, 0.99]. Below 10 samples the
interval is still computed and shown, but the verdict is
:data:`TOO_FEW` and no faster/slower word is printed. Every default run
has enough (the main table 32 rounds, the scaling table 10 warm repeats, the
host table 24 rounds); every ``--quick`` run has fewer, and says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = [
    "MIN_VERDICT_SAMPLES",
    "NO_DIFFERENCE",
    "SMOKE_RUN",
    "TOO_FEW",
    "RatioInterval",
    "median",
    "ratio_interval",
    "summary",
    "verdict",
]

NO_DIFFERENCE = "no difference measured"
#: The fewest paired samples a verdict rests on (see [Note: too few rounds for a verdict]).
MIN_VERDICT_SAMPLES = 10
#: The verdict of an interval over fewer samples.
TOO_FEW = "too few rounds for a verdict"
#: What a run with such intervals says once, instead of verdicts.
SMOKE_RUN = "smoke run: too few rounds for verdicts"


@dataclass(frozen=True, slots=True)
class RatioInterval:
    """median(arm) / median(reference) and its bootstrap interval."""

    ratio: float
    low: float
    high: float
    level: float
    resamples: int
    paired: bool
    #: Samples the interval rests on (rounds when paired; the smaller side when not).
    samples: int = MIN_VERDICT_SAMPLES

    @property
    def verdict(self) -> str:
        """``faster`` / ``slower`` where the interval excludes 1, else ``no difference measured``;
        :data:`TOO_FEW` below :data:`MIN_VERDICT_SAMPLES` samples."""
        return verdict(self.low, self.high, samples=self.samples)

    def as_dict(self) -> dict[str, Any]:
        """The JSON form, with the verdict."""
        return {**asdict(self), "verdict": self.verdict}


def verdict(low: float, high: float, *, samples: int = MIN_VERDICT_SAMPLES) -> str:
    """The claim an interval [low, high] of a time ratio (ours / torch) over ``samples`` supports."""
    if samples < MIN_VERDICT_SAMPLES:
        return TOO_FEW
    if high < 1.0:
        return "faster"
    if low > 1.0:
        return "slower"
    return NO_DIFFERENCE


def median(samples: Sequence[float]) -> float:
    """The median (the mean of the two middle values for an even count); nan when empty."""
    if not samples:
        return math.nan
    return float(torch.tensor(samples, dtype=torch.float64).quantile(0.5))


def summary(samples: Sequence[float]) -> dict[str, float]:
    """min, median and max of ``samples``."""
    if not samples:
        return {"min": math.nan, "median": math.nan, "max": math.nan}
    return {"min": min(samples), "median": median(samples), "max": max(samples)}


def ratio_interval(
    samples: Sequence[float],
    reference: Sequence[float],
    *,
    paired: bool = True,
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> RatioInterval:
    """Bootstrap interval of ``median(samples) / median(reference)``.

    ``paired``: the i-th samples belong together (same round) and are
    resampled together; both sequences must then have the same length.
    """
    a = torch.tensor(list(samples), dtype=torch.float64)
    b = torch.tensor(list(reference), dtype=torch.float64)
    if a.numel() == 0 or b.numel() == 0:
        raise ValueError("ratio_interval needs at least one sample on each side")
    if paired and a.numel() != b.numel():
        raise ValueError(f"paired samples need equal lengths, got {a.numel()} and {b.numel()}")
    if not (0.0 < level < 1.0) or resamples < 1:
        raise ValueError(f"need 0 < level < 1 and resamples >= 1, got {level}, {resamples}")
    gen = torch.Generator().manual_seed(seed)
    idx_a = torch.randint(a.numel(), (resamples, a.numel()), generator=gen)
    idx_b = idx_a if paired else torch.randint(b.numel(), (resamples, b.numel()), generator=gen)
    ratios = a[idx_a].quantile(0.5, dim=1) / b[idx_b].quantile(0.5, dim=1)
    tail = (1.0 - level) / 2
    low, high = ratios.quantile(torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    point = float(a.quantile(0.5) / b.quantile(0.5))
    n = a.numel() if paired else min(a.numel(), b.numel())
    return RatioInterval(point, low, high, level, resamples, paired, n)
