"""The plugin machinery's second tier: registry details, built-in kernels and helpers for plugin authors.

The user face (:mod:`shardscale.core`) carries what a plugin implements and
registers with (the protocols, :func:`~shardscale.core.hookimpl`,
:func:`~shardscale.core.get_registry`); this module carries what fewer need:
the entry-point group and environment variables, the registry's records, the
other built-in kernels, and helpers the integrations share.
"""

from __future__ import annotations

from shardscale.core._blas_kernels import BlasDotKernels
from shardscale.core._hookspecs import ENTRY_POINT_GROUP, HOOK_KINDS, PROJECT
from shardscale.core._lazy import lazy_exports
from shardscale.core._loop_kernels import LoopKernels
from shardscale.core._plain_adapter import is_fsdp1_param
from shardscale.core._protocols import CompletedHandle
from shardscale.core._registry import (
    BACKEND_ENV,
    DISABLE_ENV,
    IN_PROCESS,
    ItemInfo,
    LoadFailure,
    PluginInfo,
    reset_registry,
)

__all__ = [
    "PROJECT",
    "ENTRY_POINT_GROUP",
    "HOOK_KINDS",
    "DISABLE_ENV",
    "BACKEND_ENV",
    "IN_PROCESS",
    "PluginInfo",
    "ItemInfo",
    "LoadFailure",
    "reset_registry",
    "CompletedHandle",
    "BlasDotKernels",
    "LoopKernels",
    "is_fsdp1_param",
    "lazy_exports",
]
