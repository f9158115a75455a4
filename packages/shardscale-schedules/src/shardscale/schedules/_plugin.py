"""shardscale-schedules' plugin module: metadata only, so ``shardscale plugins`` lists it.

It implements no hook: schedules and averaged weights are built by the training
loop, not found through the registry. Loading it imports the package, which
needs nothing but torch (already loaded with core), so the registry stays cheap.
"""

from __future__ import annotations

__all__: list[str] = []
