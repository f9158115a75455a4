"""shardscale.core: the plugin registry, the protocols plugins implement, and ShardedGradScaler.

Quick start::

    from shardscale.core import ShardedGradScaler

    scaler = ShardedGradScaler("cpu")          # or "cuda"; same arguments as torch.amp.GradScaler
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
"""

from __future__ import annotations

from shardscale.core._blas_kernels import BlasDotKernels
from shardscale.core._errors import (
    BackendUnavailableError,
    DeclarationError,
    GradientDtypeError,
    LayoutError,
    ObserverSettingError,
    PluginConflictError,
    PluginNotFoundError,
    PluginWarning,
    ShardscaleError,
    SkipStreakError,
)
from shardscale.core._foreach_kernels import ForeachKernels
from shardscale.core._hookspecs import ENTRY_POINT_GROUP, HOOK_KINDS, PROJECT, hookimpl
from shardscale.core._lazy import lazy_exports
from shardscale.core._local import LocalBackend
from shardscale.core._loop_kernels import LoopKernels
from shardscale.core._middleware_base import MiddlewareBase
from shardscale.core._plain_adapter import PlainTensorAdapter, is_fsdp1_param
from shardscale.core._protocols import (
    AdapterContext,
    CollectiveBackend,
    CompletedHandle,
    GradAdapter,
    GradShard,
    Handle,
    Middleware,
    ReduceOp,
    StatsKernels,
    StepRecord,
)
from shardscale.core._registry import (
    BACKEND_ENV,
    DISABLE_ENV,
    IN_PROCESS,
    ItemInfo,
    LoadFailure,
    PluginInfo,
    Registry,
    get_registry,
    reset_registry,
)
from shardscale.core.scaler._iteration import Iteration, step_and_flag
from shardscale.core.scaler._overflow import OverflowReport
from shardscale.core.scaler._scaler import OptState, ScalerStateError, ShardedGradScaler
from shardscale.core.step import (
    EPS,
    Apply,
    GradientDeviceError,
    PrecomputedNorms,
    StepConfig,
    StepError,
    StepRequest,
    StepResult,
    poll_errors,
    read_tensor_norm,
    run_step,
)
from shardscale.core.step._aliasing import AliasedGradientError
from shardscale.core.step._clip import clip_parameters_, norm_dtype
from shardscale.core.step._collect import GradBuckets, collect_grads, optimizer_params
from shardscale.core.step._contract import (
    check_distinct_dims,
    check_error_if_nonfinite,
    check_kernels,
    check_loss_scaling,
    check_max_consecutive_skips,
    check_max_norm,
    check_norm_type,
    check_spike,
    distinct_param_ids,
    kernels_name,
    nonfinite_norm_error,
)
from shardscale.core.step._policy import PolicyState, SkipPolicy
from shardscale.core.step._vector import VectorLayout
from shardscale.core.step._verdict import SkipReason, SpikeSkip

__all__ = [
    # the scaler
    "ShardedGradScaler",
    "OptState",
    "OverflowReport",
    # why a step is skipped: the verdict's policies and reasons (docs/skipped-steps.md)
    "SkipReason",
    "SpikeSkip",
    "SkipPolicy",
    "PolicyState",
    "SkipStreakError",
    # several optimizers, one update (front ends: see [Note: one update per iteration])
    "Iteration",
    "step_and_flag",
    # the step engine every caller goes through
    "run_step",
    "lazy_exports",
    "clip_parameters_",
    "norm_dtype",
    "StepConfig",
    "StepRequest",
    "StepResult",
    "VectorLayout",
    "distinct_param_ids",
    "StepError",
    "GradientDeviceError",
    "Apply",
    "PrecomputedNorms",
    "read_tensor_norm",
    "poll_errors",
    "EPS",
    # the step contract: every option checked once, one error text (see [Note: one contract])
    "check_max_norm",
    "check_norm_type",
    "check_error_if_nonfinite",
    "check_kernels",
    "kernels_name",
    "check_distinct_dims",
    "check_loss_scaling",
    "check_spike",
    "check_max_consecutive_skips",
    "nonfinite_norm_error",
    # registry
    "Registry",
    "get_registry",
    "reset_registry",
    "hookimpl",
    "PROJECT",
    "ENTRY_POINT_GROUP",
    "HOOK_KINDS",
    "DISABLE_ENV",
    "BACKEND_ENV",
    "IN_PROCESS",
    "PluginInfo",
    "ItemInfo",
    "LoadFailure",
    # protocols and data
    "ReduceOp",
    "Handle",
    "CompletedHandle",
    "CollectiveBackend",
    "Middleware",
    "MiddlewareBase",
    "GradShard",
    "AdapterContext",
    "GradAdapter",
    "StatsKernels",
    "StepRecord",
    # built-ins
    "LocalBackend",
    "PlainTensorAdapter",
    "is_fsdp1_param",
    "ForeachKernels",
    "BlasDotKernels",
    "LoopKernels",
    # gradient collection shared with shardscale.clip
    "GradBuckets",
    "collect_grads",
    "optimizer_params",
    # errors
    "ShardscaleError",
    "PluginNotFoundError",
    "PluginConflictError",
    "BackendUnavailableError",
    "LayoutError",
    "AliasedGradientError",
    "DeclarationError",
    "GradientDtypeError",
    "ScalerStateError",
    "ObserverSettingError",
    "PluginWarning",
]
