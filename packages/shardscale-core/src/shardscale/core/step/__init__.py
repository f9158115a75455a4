"""The step engine, one stage per module, and its second tier for sibling distributions.

Read in call order: ``_types`` (options, request, result), ``_collect_stage``
(with ``_collect``, ``_plan`` and ``_layout_groups``: which adapter owns each
gradient, the step plan), ``_check`` (with ``_contract``), ``_read``,
``_reduce`` (with ``_vector``), ``_arith`` (the vector's device arithmetic),
``_verdict``, ``_decide`` (decide and apply), ``_errors`` (errors that reach
every rank) and ``_clip`` (the clip functions' shared body); ``_engine``'s
:func:`run_step` calls them in that order.

Users reach the engine through :class:`~shardscale.core.ShardedGradScaler`
and ``shardscale.clip``; sibling distributions (``shardscale.clip``, the
integrations, the CLI) import what they need from here, never from a private
module.
"""

from __future__ import annotations

from shardscale.core._eager import eager
from shardscale.core.step._buckets import GradBuckets, optimizer_params
from shardscale.core.step._clip import clip_parameters_, norm_dtype
from shardscale.core.step._collect import collect_grads
from shardscale.core.step._contract import (
    check_distinct_dims,
    check_error_if_nonfinite,
    check_kernels,
    check_max_norm,
    check_norm_type,
    distinct_param_ids,
    kernels_name,
    nonfinite_norm_error,
)
from shardscale.core.step._engine import read_tensor_norm, run_step
from shardscale.core.step._errors import poll_errors
from shardscale.core.step._plan import StepPlans
from shardscale.core.step._types import (
    EPS,
    Apply,
    PrecomputedNorms,
    StepConfig,
    StepRequest,
    StepResult,
)
from shardscale.core.step._vector import VectorLayout

__all__ = [
    # one step
    "run_step",
    "StepConfig",
    "StepRequest",
    "StepResult",
    "Apply",
    "EPS",
    "PrecomputedNorms",
    "read_tensor_norm",
    "poll_errors",
    "VectorLayout",
    "StepPlans",
    "eager",
    # what the clip functions share
    "clip_parameters_",
    "norm_dtype",
    "GradBuckets",
    "collect_grads",
    "optimizer_params",
    # the contract: every option checked once, one error text
    "check_max_norm",
    "check_norm_type",
    "check_error_if_nonfinite",
    "check_kernels",
    "kernels_name",
    "check_distinct_dims",
    "distinct_param_ids",
    "nonfinite_norm_error",
]
