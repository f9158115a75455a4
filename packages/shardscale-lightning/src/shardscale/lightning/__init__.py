"""shardscale.lightning: shardscale's scaler and clipping in a Lightning ``Trainer``, in one line.

Quick start::

    from lightning.pytorch import Trainer
    from shardscale.lightning import ShardscalePrecision

    # was: Trainer(strategy="fsdp", precision="16-mixed", gradient_clip_val=1.0)
    trainer = Trainer(strategy="fsdp", plugins=[ShardscalePrecision("16-mixed")],
                      gradient_clip_val=1.0)

See docs/lightning.md for what it fixes and which strategies it was tested with.
Names load on first use, so the registry can import ``shardscale.lightning._plugin``
without importing Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardscale.core.plugins import lazy_exports

if TYPE_CHECKING:
    from shardscale.lightning._precision import PrecisionName, ShardscalePrecision
    from shardscale.lightning._schedulers import hold_on_skipped_steps, is_held

__all__ = ["ShardscalePrecision", "PrecisionName", "hold_on_skipped_steps", "is_held"]

_WHERE = {
    "ShardscalePrecision": "shardscale.lightning._precision",
    "PrecisionName": "shardscale.lightning._precision",
    "hold_on_skipped_steps": "shardscale.lightning._schedulers",
    "is_held": "shardscale.lightning._schedulers",
}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
