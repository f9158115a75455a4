"""The benchmark behind ``shardscale bench`` and ``nox -s bench``: shardscale against torch.

[Note: a benchmark a sceptic accepts]
* Arms: torch's recipe, the same recipe again (A/A: the noise floor),
  ``unscale_and_clip_``, and ``unscale_and_clip_`` with streaming statistics;
  each on its own copy of one FSDP2 model, fed the same data.
* Balanced interleaving (``_order``): every round runs every arm once, in a
  Williams order, so drift of a shared machine hits every arm alike.
* Intervals (``_stats``): ratios of medians with 95 % paired bootstrap
  intervals; "faster" or "slower" only where the interval excludes 1.
* Bytes (``_bytes``): counted per aten op while post-processing and the
  optimizer run, not computed from a pass count.
* Streaming statistics are charged inside backward: the whole step is timed.
* Scaling (``_scaling``): unscale + clip against the number of parameters,
  cold (first call on a layout) and warm.

Modules: ``_config`` (options and their checks), ``_workload`` (model,
sharding, optimizers), ``_arms``, ``_harness`` (timed rounds and counts of
one configuration), ``_scaling``, ``_launch`` (processes), ``_report``
(analysis, text, Markdown, JSON).
"""

from __future__ import annotations

from shardscale.cli.bench._bytes import GradBytesCounter
from shardscale.cli.bench._config import BenchConfig, BenchOptionError, check_config, quick
from shardscale.cli.bench._launch import run_benchmark
from shardscale.cli.bench._order import balanced_order, rounds_for
from shardscale.cli.bench._report import (
    analyse,
    format_markdown,
    format_ranges,
    format_table,
    write_json,
)
from shardscale.cli.bench._stats import RatioInterval, ratio_interval, verdict

__all__ = [
    "BenchConfig",
    "BenchOptionError",
    "GradBytesCounter",
    "RatioInterval",
    "analyse",
    "balanced_order",
    "check_config",
    "format_markdown",
    "format_ranges",
    "format_table",
    "quick",
    "ratio_interval",
    "rounds_for",
    "run_benchmark",
    "verdict",
    "write_json",
]
