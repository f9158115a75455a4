"""shardscale-collectives's plugin module, listed in the ``shardscale`` entry-point group."""

from __future__ import annotations

from collections.abc import Sequence

from shardscale.collectives._c10d import C10dBackend
from shardscale.collectives._coalescing import CoalescingMiddleware
from shardscale.collectives._counting import CountingMiddleware
from shardscale.collectives._named_backends import GlooBackend, NcclBackend
from shardscale.core import hookimpl

__all__ = ["shardscale_collective_backends", "shardscale_middlewares"]


@hookimpl
def shardscale_collective_backends() -> Sequence[type]:
    """``c10d`` (any torch.distributed backend), ``gloo`` and ``nccl`` (checked)."""
    return [C10dBackend, GlooBackend, NcclBackend]


@hookimpl
def shardscale_middlewares() -> Sequence[type]:
    """``counting`` and ``coalescing``."""
    return [CountingMiddleware, CoalescingMiddleware]
