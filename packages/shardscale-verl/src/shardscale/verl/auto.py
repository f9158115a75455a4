"""Importing this module applies ``use_shardscale`` to every verl FSDP engine (or 0.7 actor) built afterwards.

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

On verl 0.7 (the legacy worker, which imports ``external_lib`` at the start of
``init_model``, before it builds its actor) it wraps ``DataParallelPPOActor.__init__``
instead: the training actor (the one built with an optimizer) gets
``use_shardscale(actor)``; the reference policy is left alone. The worker's
checkpoint manager is built after the actor and is not reached from here: the
scaler's state is not in that worker's checkpoints (call
``use_shardscale(actor, checkpoint_manager=...)`` yourself for that).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["install"]

_MARK = "__shardscale_verl__"


def install() -> None:
    """Wrap verl's ``FSDPEngine.initialize`` (verl 0.9) or ``DataParallelPPOActor.__init__``
    (verl 0.7); idempotent (the import already did it)."""
    from shardscale.verl._contract import check_verl, installed_kind

    if installed_kind() == "actor":
        _install_legacy()
        return
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

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


def _install_legacy() -> None:
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    from shardscale.verl._contract import check_verl

    original: Callable[..., Any] = DataParallelPPOActor.__init__
    if getattr(original, _MARK, False):
        return
    check_verl()

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if getattr(self, "actor_optimizer", None) is not None:
            from shardscale.verl._install import use_shardscale

            use_shardscale(self)

    setattr(__init__, _MARK, True)
    DataParallelPPOActor.__init__ = __init__


install()
