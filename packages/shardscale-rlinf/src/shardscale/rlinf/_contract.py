"""What shardscale.rlinf relies on in RLinf's ``FSDPModelManager``, checked before it acts.

[Note: why a contract check]
``ShardscaleFSDP`` overrides five methods that RLinf's ``FSDPModelManager``
(``rlinf/hybrid_engines/fsdp/fsdp_model_manager.py``) defines for its
subclasses (the actor, SFT and reward workers): ``build_grad_scaler``,
``build_lr_scheduler``, ``optimizer_step``, ``save_checkpoint`` and
``load_checkpoint``, and reads the
manager's ``_cfg.optim.clip_grad``, ``optimizer`` and ``critic_warmup_steps``.
An override RLinf stops calling would be bypassed silently, so
:func:`check_rlinf` compares names and signatures with the release this was
tested with (:data:`TESTED_RLINF`) and raises :class:`RLinfContractError`
naming each difference, when the scaler is built, before anything trains.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["TESTED_RLINF", "RLinfContractError", "check_rlinf", "contract_problems"]

#: The RLinf release the tests run (noxfile RLINF pins it).
TESTED_RLINF = "0.3.0"

# (method of FSDPModelManager, the leading parameter names it must accept)
_METHODS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("setup_model_and_optimizer", ("self",)),
    ("build_grad_scaler", ("self", "enabled")),
    ("build_lr_scheduler", ("self", "optimizer", "optim_config")),
    ("optimizer_step", ("self",)),
    ("save_checkpoint", ("self", "save_path")),
    ("load_checkpoint", ("self", "load_path")),
)
# Instance attributes a set-up manager has that ShardscaleFSDP reads.
_ATTRIBUTES = ("_cfg", "optimizer", "critic_warmup_steps", "optimizer_steps")


class RLinfContractError(RuntimeError):
    """The installed RLinf no longer has what shardscale.rlinf overrides or reads."""


def _manager_class() -> type:
    from rlinf.hybrid_engines.fsdp.fsdp_model_manager import FSDPModelManager

    cls: type = FSDPModelManager
    return cls


def _rlinf_version() -> str:
    import importlib.metadata as md

    try:
        return md.version("rlinf")
    except md.PackageNotFoundError:
        return "unknown"


def contract_problems(manager: Any | None = None) -> list[str]:
    """Every mismatch between the installed RLinf and what shardscale.rlinf relies on.

    With ``manager`` (an ``FSDPModelManager`` whose optimizer is built), its
    attributes are checked too.
    """
    cls = _manager_class()
    problems: list[str] = []
    for attr, params in _METHODS:
        member = inspect.getattr_static(cls, attr, None)
        if member is None or not callable(member):
            problems.append(f"FSDPModelManager.{attr} is gone or no longer a method")
            continue
        names = tuple(inspect.signature(member).parameters)[: len(params)]
        if names != params:
            problems.append(
                f"FSDPModelManager.{attr} now takes ({', '.join(names)}), "
                f"expected ({', '.join(params)})"
            )
    if manager is not None:
        problems.extend(
            f"FSDPModelManager instances no longer have .{name}"
            for name in _ATTRIBUTES
            if not hasattr(manager, name)
        )
        cfg = getattr(manager, "_cfg", None)
        optim = cfg.get("optim", None) if cfg is not None else None
        if optim is None or optim.get("clip_grad", None) is None:
            problems.append("the manager's config has no optim.clip_grad")
    if problems:
        problems.append(f"(installed rlinf {_rlinf_version()}; tested {TESTED_RLINF})")
    return problems


def check_rlinf(manager: Any | None = None) -> None:
    """Raise :class:`RLinfContractError` listing every mismatch (see :func:`contract_problems`)."""
    problems = contract_problems(manager)
    if problems:
        raise RLinfContractError(
            "shardscale.rlinf cannot take over RLinf's scaler: RLinf changed what it relies "
            "on:\n  " + "\n  ".join(problems) + f"\nInstall rlinf=={TESTED_RLINF}, or a "
            "shardscale-rlinf release that supports your RLinf."
        )
