"""The step engine: collect, check, read, reduce once, decide, apply (the second tier).

Sibling distributions (``shardscale.clip``, ``shardscale.fsdp``, the
integrations) reach the engine through the names exported here; users reach
it through :class:`~shardscale.core.ShardedGradScaler` and ``shardscale.clip``.
"""

from __future__ import annotations
