"""shardscale-schedules' plugin module: metadata only, so ``shardscale plugins`` lists it.

It implements no hook (schedules and averaged weights are built by the training
loop, not found through the registry) and imports nothing: loading the registry
must stay cheap.
"""

from __future__ import annotations

__all__: list[str] = []
