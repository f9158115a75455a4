"""shardscale-lightning's plugin module: metadata only, so ``shardscale plugins`` lists it.

It implements no hook (the precision plugin is used by the Trainer, not found
through the registry) and never imports Lightning: loading the registry must
stay cheap.
"""

from __future__ import annotations

__all__: list[str] = []
