"""shardscale.transformers: shardscale's scaler and clipping in a 🤗 ``Trainer`` (and TRL's).

Quick start::

    from transformers import Trainer, TrainingArguments
    from shardscale.transformers import use_shardscale

    trainer = Trainer(model=model, args=TrainingArguments(..., fp16=True), ...)
    use_shardscale(trainer)                # the one added line, before train()
    trainer.train()

See docs/transformers.md for what it fixes and exactly what it overrides. It is
built on ``shardscale.accelerate`` (the Trainer runs on an ``Accelerator``).
Names load on first use, so the registry can import
``shardscale.transformers._plugin`` without importing transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardscale.core.plugins import lazy_exports

if TYPE_CHECKING:
    from shardscale.transformers._callback import LOG_KEYS, ShardscaleCallback
    from shardscale.transformers._contract import (
        TESTED_TRANSFORMERS,
        TransformersContractError,
        check_transformers,
        transformers_contract_problems,
    )
    from shardscale.transformers._install import is_using_shardscale, use_shardscale

__all__ = [
    "use_shardscale",
    "is_using_shardscale",
    "ShardscaleCallback",
    "LOG_KEYS",
    "check_transformers",
    "transformers_contract_problems",
    "TransformersContractError",
    "TESTED_TRANSFORMERS",
]

_CALLBACK = "shardscale.transformers._callback"
_CONTRACT = "shardscale.transformers._contract"
_INSTALL = "shardscale.transformers._install"
_WHERE = {
    "use_shardscale": _INSTALL,
    "is_using_shardscale": _INSTALL,
    "ShardscaleCallback": _CALLBACK,
    "LOG_KEYS": _CALLBACK,
    "check_transformers": _CONTRACT,
    "transformers_contract_problems": _CONTRACT,
    "TransformersContractError": _CONTRACT,
    "TESTED_TRANSFORMERS": _CONTRACT,
}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
