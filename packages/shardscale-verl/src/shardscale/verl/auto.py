"""Importing this module applies ``use_shardscale`` to every verl FSDP engine built afterwards.

It is the config-key form of the one line, for verl's Ray trainer, where the
workers build the engines::

    python -m verl.trainer.main_ppo ... \\
        actor_rollout_ref.model.external_lib=shardscale.verl.auto

verl imports a model config's ``external_lib`` in every worker when it builds
that config (``HFModelConfig.__post_init__``), before the worker builds its
engine. On import, this module wraps ``FSDPEngine.initialize`` (verl's class,
once per process; importing it again changes nothing) so that an engine that
has an optimizer after verl's own ``initialize`` gets
``use_shardscale(engine)`` with its defaults: fp16 engines scale the loss,
bf16/fp32 engines get the non-finite guard. Forward-only engines (reference
policy, rollout-side log-probs) are left as verl built them. That one wrapped
method is the only change to verl's classes; for other scaler options call
``use_shardscale(engine, ...)`` yourself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["install"]

_MARK = "__shardscale_verl__"


def install() -> None:
    """Wrap verl's ``FSDPEngine.initialize`` (idempotent; the import already did it)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    from shardscale.verl._contract import check_verl

    original: Callable[..., Any] = FSDPEngine.initialize
    if getattr(original, _MARK, False):
        return
    check_verl()  # before verl's class changes, not at the first engine

    @functools.wraps(original)
    def initialize(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if getattr(self, "optimizer", None) is not None:
            from shardscale.verl._install import use_shardscale

            use_shardscale(self)
        return result

    setattr(initialize, _MARK, True)
    FSDPEngine.initialize = initialize


install()
