"""shardscale.accelerate: shardscale's scaler and clipping in a Hugging Face ``Accelerator``.

Quick start::

    from accelerate import Accelerator
    from shardscale.accelerate import use_shardscale

    accelerator = Accelerator(mixed_precision="fp16")
    use_shardscale(accelerator)            # the one added line, before prepare()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

See docs/accelerate.md for what it fixes and exactly what it overrides.
"""

from __future__ import annotations

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

__all__ = [
    "use_shardscale",
    "is_using_shardscale",
    "ShardscaleAcceleratedOptimizer",
    "check_accelerate",
    "contract_problems",
    "AccelerateContractError",
    "TESTED_ACCELERATE",
]
