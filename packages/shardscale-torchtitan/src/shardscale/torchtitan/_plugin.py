"""shardscale-torchtitan's plugin module: metadata only, so ``shardscale plugins`` lists it.

It implements no hook (``clip_grad_norm_`` is called from a training loop) and
imports neither torchtitan nor torch: loading the registry must stay cheap.
"""

from __future__ import annotations

__all__: list[str] = []
