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
from shardscale.core._hookspecs import hookimpl
from shardscale.core._local import LocalBackend
from shardscale.core._middleware_base import MiddlewareBase
from shardscale.core._plain_adapter import PlainTensorAdapter
from shardscale.core._protocols import (
    AdapterContext,
    CollectiveBackend,
    GradAdapter,
    GradShard,
    Handle,
    Middleware,
    ReduceOp,
    StatsKernels,
    StepRecord,
)
from shardscale.core._registry import Registry, get_registry
from shardscale.core.scaler._options import Layout, LossCheck, ScaleBounds, SkipStreakLimit
from shardscale.core.scaler._scaler import ShardedGradScaler
from shardscale.core.scaler._values import ScalerStateError
from shardscale.core.step._aliasing import AliasedGradientError
from shardscale.core.step._errors import GradientDeviceError, StepError
from shardscale.core.step._policy import PolicyState, SkipPolicy
from shardscale.core.step._verdict import SkipReason, SpikeSkip

# [Note: the face and its tiers]
# This face is what users and plugin authors use (at most 40 names). The engine's
# second tier for sibling distributions is shardscale.core.step; the scaler's is
# shardscale.core.scaler; the plugin machinery's is shardscale.core.plugins.
__all__ = [
    # the scaler and its options (see [Note: the scaler's options])
    "ShardedGradScaler",
    "Layout",
    "ScaleBounds",
    "SpikeSkip",
    "LossCheck",
    "SkipStreakLimit",
    "SkipPolicy",
    "PolicyState",
    # why a step was skipped, and what observers receive
    "SkipReason",
    "StepRecord",
    # registry
    "Registry",
    "get_registry",
    "hookimpl",
    # protocols plugins implement
    "ReduceOp",
    "Handle",
    "CollectiveBackend",
    "Middleware",
    "MiddlewareBase",
    "GradShard",
    "AdapterContext",
    "GradAdapter",
    "StatsKernels",
    # built-ins to use or extend
    "LocalBackend",
    "PlainTensorAdapter",
    "ForeachKernels",
    # errors
    "ShardscaleError",
    "PluginNotFoundError",
    "PluginConflictError",
    "BackendUnavailableError",
    "LayoutError",
    "AliasedGradientError",
    "DeclarationError",
    "GradientDtypeError",
    "GradientDeviceError",
    "StepError",
    "ScalerStateError",
    "ObserverSettingError",
    "PluginWarning",
    "SkipStreakError",
]
