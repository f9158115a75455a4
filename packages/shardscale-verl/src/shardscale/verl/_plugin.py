"""shardscale-verl's plugin module: metadata only, so ``shardscale plugins`` lists it.

It implements no hook (``use_shardscale`` is called on a verl engine, not found
through the registry) and never imports verl: loading the registry must stay
cheap.
"""

from __future__ import annotations

__all__: list[str] = []
