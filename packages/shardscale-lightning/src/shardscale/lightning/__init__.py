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

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'shardscale.lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
