"""shardscale-rlinf's plugin module: metadata only, so ``shardscale plugins`` lists it.

It implements no hook (``ShardscaleFSDP`` is mixed into an RLinf worker class,
not found through the registry) and never imports RLinf: loading the registry
must stay cheap.
"""

from __future__ import annotations

__all__: list[str] = []
