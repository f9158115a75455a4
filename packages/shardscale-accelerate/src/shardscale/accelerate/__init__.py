"""shardscale.accelerate: shardscale's scaler and clipping in a Hugging Face ``Accelerator``.

Quick start::

    from accelerate import Accelerator
    from shardscale.accelerate import use_shardscale

    accelerator = Accelerator(mixed_precision="fp16")
    use_shardscale(accelerator)            # the one added line, before prepare()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

See docs/accelerate.md for what it fixes and exactly what it overrides. Names
load on first use, so the registry can import ``shardscale.accelerate._plugin``
without importing Accelerate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardscale.core.plugins import lazy_exports

if TYPE_CHECKING:
    from shardscale.accelerate._contract import (
        TESTED_ACCELERATE,
        AccelerateContractError,
        check_accelerate,
        contract_problems,
    )
    from shardscale.accelerate._install import (
        ShardscaleAcceleratedOptimizer,
        is_using_shardscale,
        use_shardscale,
    )
    from shardscale.accelerate._scheduler import ShardscaleAcceleratedScheduler

__all__ = [
    "use_shardscale",
    "is_using_shardscale",
    "ShardscaleAcceleratedOptimizer",
    "ShardscaleAcceleratedScheduler",
    "check_accelerate",
    "contract_problems",
    "AccelerateContractError",
    "TESTED_ACCELERATE",
]

_CONTRACT = "shardscale.accelerate._contract"
_INSTALL = "shardscale.accelerate._install"
_SCHEDULER = "shardscale.accelerate._scheduler"
_WHERE = {
    "use_shardscale": _INSTALL,
    "is_using_shardscale": _INSTALL,
    "ShardscaleAcceleratedOptimizer": _INSTALL,
    "ShardscaleAcceleratedScheduler": _SCHEDULER,
    "check_accelerate": _CONTRACT,
    "contract_problems": _CONTRACT,
    "AccelerateContractError": _CONTRACT,
    "TESTED_ACCELERATE": _CONTRACT,
}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
