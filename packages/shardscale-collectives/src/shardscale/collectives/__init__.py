"""shardscale.collectives: collective backends and middleware for shardscale, found by name.

Backends: ``c10d`` (reduces through ``torch.distributed`` over any process
group, whatever its library), ``gloo`` and ``nccl`` (``c10d`` plus a check that
the group really uses that library). Middleware wrap any backend:
``counting`` records every collective, ``coalescing`` merges small reductions
into one collective per group and op. Compose them by name, left to right::

    SHARDSCALE_BACKEND=counting+coalescing+c10d
    ShardedGradScaler("cuda", backend="counting+nccl")

You rarely import this package: the registry finds it through its entry point.
Tests and benchmarks use :func:`find_middleware` to read the ``counting`` records.
"""

from __future__ import annotations

from shardscale.collectives._c10d import C10dBackend, CollectiveError, WorkHandle
from shardscale.collectives._chain import chain_names, find_middleware, iter_chain
from shardscale.collectives._coalescing import CoalescingMiddleware
from shardscale.collectives._counting import CollectiveRecord, CountingMiddleware
from shardscale.collectives._named_backends import GlooBackend, NcclBackend

__all__ = [
    "C10dBackend",
    "CollectiveError",
    "GlooBackend",
    "NcclBackend",
    "WorkHandle",
    "CountingMiddleware",
    "CollectiveRecord",
    "CoalescingMiddleware",
    "find_middleware",
    "chain_names",
    "iter_chain",
]
