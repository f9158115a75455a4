"""The scaler: torch's GradScaler state machine over the step engine, and its second tier.

:class:`~shardscale.core.ShardedGradScaler` and its option objects are on the
user face (:mod:`shardscale.core`); this module adds what front ends use:
torch's ``OptState``, the overflow report, and one update over several
optimizers (:class:`Iteration`, :func:`step_and_flag`).
"""

from __future__ import annotations

from shardscale.core.scaler._iteration import Iteration, step_and_flag
from shardscale.core.scaler._overflow import OverflowReport
from shardscale.core.scaler._scaler import OptState, ShardedGradScaler

__all__ = ["ShardedGradScaler", "OptState", "OverflowReport", "Iteration", "step_and_flag"]
