"""shardscale.rlinf: shardscale's loss scaler and clipping in RLinf's FSDP actors (fp16 RL).

Quick start (the worker class your RLinf main script launches)::

    from rlinf.workers.actor.fsdp_actor_worker import FSDPActor
    from shardscale.rlinf import ShardscaleFSDP

    class Actor(ShardscaleFSDP, FSDPActor):  # the one added line: launch Actor
        pass

``ShardscaleFSDP`` overrides the methods RLinf's ``FSDPModelManager`` gives
its subclasses for this (``build_grad_scaler``, ``build_lr_scheduler``,
``optimizer_step``, ``save_checkpoint``, ``load_checkpoint``); see docs/rlinf.md. Names load on
first use, so the registry can import ``shardscale.rlinf._plugin`` without
importing RLinf.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardscale.core.plugins import lazy_exports

if TYPE_CHECKING:
    from shardscale.rlinf._contract import (
        TESTED_RLINF,
        RLinfContractError,
        check_rlinf,
        contract_problems,
    )
    from shardscale.rlinf._mixin import METRIC_KEYS, ShardscaleFSDP

__all__ = [
    "ShardscaleFSDP",
    "METRIC_KEYS",
    "check_rlinf",
    "contract_problems",
    "RLinfContractError",
    "TESTED_RLINF",
]

_CONTRACT = "shardscale.rlinf._contract"
_MIXIN = "shardscale.rlinf._mixin"
_WHERE = {
    "ShardscaleFSDP": _MIXIN,
    "METRIC_KEYS": _MIXIN,
    "check_rlinf": _CONTRACT,
    "contract_problems": _CONTRACT,
    "RLinfContractError": _CONTRACT,
    "TESTED_RLINF": _CONTRACT,
}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
