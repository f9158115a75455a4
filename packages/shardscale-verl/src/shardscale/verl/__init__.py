"""shardscale.verl: shardscale's loss scaler and clipping in verl's FSDP engine and legacy actor (fp16 RL).

Quick start (verl 0.9's FSDP engine)::

    from shardscale.verl import use_shardscale

    engine.initialize()
    use_shardscale(engine)                 # the one added line

verl 0.7's legacy actor takes the same line, once the actor is built::

    use_shardscale(actor, checkpoint_manager=checkpoint_manager)

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
        SUPPORTED_VERL,
        TESTED_VERL,
        TESTED_VERL_LEGACY,
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
    from shardscale.verl._legacy import LEGACY_METRIC_KEYS

__all__ = [
    "use_shardscale",
    "is_using_shardscale",
    "engine_state",
    "ShardscaleEngineState",
    "METRIC_KEYS",
    "LEGACY_METRIC_KEYS",
    "check_verl",
    "contract_problems",
    "VerlContractError",
    "TESTED_VERL",
    "TESTED_VERL_LEGACY",
    "SUPPORTED_VERL",
]

_CONTRACT = "shardscale.verl._contract"
_INSTALL = "shardscale.verl._install"
_LEGACY = "shardscale.verl._legacy"
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
    "TESTED_VERL_LEGACY": _CONTRACT,
    "SUPPORTED_VERL": _CONTRACT,
    "LEGACY_METRIC_KEYS": _LEGACY,
}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
