"""shardscale.verl: shardscale's loss scaler and clipping in verl's FSDP engine (fp16 RL).

Quick start::

    from shardscale.verl import use_shardscale

    engine.initialize()
    use_shardscale(engine)                 # the one added line

For verl's Ray trainer, where the workers build the engine, the same line runs
from a config key: ``actor_rollout_ref.model.external_lib=shardscale.verl.auto``
(see docs/verl.md). Names load on first use, so the registry can import
``shardscale.verl._plugin`` without importing verl.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardscale.core.plugins import lazy_exports

if TYPE_CHECKING:
    from shardscale.verl._contract import (
        TESTED_VERL,
        VerlContractError,
        check_verl,
        contract_problems,
    )
    from shardscale.verl._install import (
        METRIC_KEYS,
        ShardscaleEngineState,
        engine_state,
        is_using_shardscale,
        use_shardscale,
    )

__all__ = [
    "use_shardscale",
    "is_using_shardscale",
    "engine_state",
    "ShardscaleEngineState",
    "METRIC_KEYS",
    "check_verl",
    "contract_problems",
    "VerlContractError",
    "TESTED_VERL",
]

_CONTRACT = "shardscale.verl._contract"
_INSTALL = "shardscale.verl._install"
_WHERE = {
    "use_shardscale": _INSTALL,
    "is_using_shardscale": _INSTALL,
    "engine_state": _INSTALL,
    "ShardscaleEngineState": _INSTALL,
    "METRIC_KEYS": _INSTALL,
    "check_verl": _CONTRACT,
    "contract_problems": _CONTRACT,
    "VerlContractError": _CONTRACT,
    "TESTED_VERL": _CONTRACT,
}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
