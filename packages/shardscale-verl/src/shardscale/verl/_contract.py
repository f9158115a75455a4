"""What shardscale.verl relies on in verl's FSDP engine and legacy actor, checked before any change.

[Note: why a contract check]
Neither verl's FSDP engine (``verl.workers.engine.fsdp.transformer_impl.FSDPEngine``,
verl 0.9) nor its legacy actor (``verl.workers.actor.dp_actor.DataParallelPPOActor``,
verl 0.7) has an option that chooses its loss scaler, its clipping or what happens
to the learning-rate scheduler on a skipped step. ``use_shardscale`` therefore sets
the ``scaler`` attribute (which verl's own backward reads to scale the loss) and
shadows a few methods on ONE instance (see ``_install`` and ``_legacy``). Each relies
on a name and a signature below. When verl changes one of them, :func:`check_verl`
raises :class:`VerlContractError` naming it, before anything is touched, instead
of training with a silently bypassed scaler. Each path runs on one verl release
series only (:data:`SUPPORTED_VERL`): another version is refused by name.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Literal

__all__ = [
    "SUPPORTED_VERL",
    "TESTED_VERL",
    "TESTED_VERL_LEGACY",
    "VerlContractError",
    "check_verl",
    "contract_problems",
]

#: The verl release the engine tests run (noxfile VERL pins it).
TESTED_VERL = "0.9.1"
#: The verl release the legacy actor tests run (noxfile VERL_LEGACY pins it).
TESTED_VERL_LEGACY = "0.7.1"
_ENGINE_SERIES, _ACTOR_SERIES = "0.9", "0.7"
#: What each path supports: (what it takes, the verl series, the release tested).
SUPPORTED_VERL: tuple[tuple[str, str, str], ...] = (
    ("verl's FSDP engine (FSDPEngine)", _ENGINE_SERIES, TESTED_VERL),
    ("verl 0.7's legacy actor (DataParallelPPOActor)", _ACTOR_SERIES, TESTED_VERL_LEGACY),
)

Kind = Literal["engine", "actor"]
#: Which path each verl series takes (a tuple: shared by every caller, never written).
_SERIES: tuple[tuple[Kind, str], ...] = (("engine", _ENGINE_SERIES), ("actor", _ACTOR_SERIES))
_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
_ACTOR_MODULE = "verl.workers.actor.dp_actor"

# (attribute of the class, the leading parameter names it must accept)
_ENGINE_METHODS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("initialize", ("self",)),
    ("forward_backward_batch", ("self", "data", "loss_function", "forward_only")),
    ("optimizer_step", ("self",)),
    ("train_batch", ("self", "data", "loss_function")),
    ("lr_scheduler_step", ("self",)),
    ("save_checkpoint", ("self", "local_path", "hdfs_path", "global_step", "max_ckpt_to_keep")),
    ("load_checkpoint", ("self", "local_path", "hdfs_path", "del_local_after_load")),
    ("is_mp_src_rank_with_outputs", ("self",)),
)
_ACTOR_METHODS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("_optimizer_step", ("self",)),
    ("update_policy", ("self", "data")),
)
_MANAGER_METHODS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("save_checkpoint", ("self", "local_path", "hdfs_path", "global_step", "max_ckpt_to_keep")),
    ("load_checkpoint", ("self", "local_path", "hdfs_path", "del_local_after_load")),
)
# Instance attributes use_shardscale reads or replaces.
_ENGINE_ATTRIBUTES = ("scaler", "optimizer", "lr_scheduler", "module", "optimizer_config")
_ACTOR_ATTRIBUTES = ("scaler", "actor_optimizer", "actor_module", "config")


class VerlContractError(RuntimeError):
    """The installed verl is not one shardscale.verl supports, or no longer has what it relies on."""


def _supported() -> str:
    return "; ".join(
        f"{what} on verl {series} (tested {tested})" for what, series, tested in SUPPORTED_VERL
    )


def _installed() -> str:
    import verl

    version: str = verl.__version__
    return version


def _series(version: str) -> str:
    return ".".join(version.split(".")[:2])


def installed_kind() -> Kind:
    """Which path the installed verl supports ("engine" on 0.9, "actor" on 0.7); else raises."""
    version = _installed()
    for kind, series in _SERIES:
        if _series(version) == series:
            return kind
    raise VerlContractError(
        f"shardscale.verl does not support the installed verl {version}. It supports: "
        f"{_supported()}. Install verl=={TESTED_VERL} (the engine) or verl=={TESTED_VERL_LEGACY} "
        "(the legacy actor), or a shardscale-verl release that supports your verl."
    )


def _engine_class() -> type:
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    cls: type = FSDPEngine
    return cls


def _actor_class() -> type:
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    cls: type = DataParallelPPOActor
    return cls


def _manager_class() -> type:
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    cls: type = FSDPCheckpointManager
    return cls


def target_kind(target: Any) -> Kind:
    """Which path ``target`` takes under the installed verl; raises naming what is supported.

    Only the installed series' module is imported; the other path's class is
    recognised only if verl already imported it (a 0.7 engine, say), to name it.
    """
    kind = installed_kind()
    own = _engine_class() if kind == "engine" else _actor_class()
    if isinstance(target, own):
        return kind
    other = sys.modules.get(_ACTOR_MODULE if kind == "engine" else _ENGINE_MODULE)
    other_cls = getattr(other, "FSDPEngine" if kind == "actor" else "DataParallelPPOActor", None)
    if isinstance(other_cls, type) and isinstance(target, other_cls):
        raise VerlContractError(
            f"use_shardscale got a {type(target).__name__} under verl {_installed()}, which "
            f"shardscale.verl does not support there. It supports: {_supported()}."
        )
    raise TypeError(
        "use_shardscale takes verl's FSDP engine (verl.workers.engine.fsdp.transformer_impl."
        "FSDPEngine, verl 0.9) or verl 0.7's legacy actor (verl.workers.actor.dp_actor."
        f"DataParallelPPOActor), got {type(target).__name__}"
    )


def _method_problems(
    cls: type, name: str, methods: tuple[tuple[str, tuple[str, ...]], ...]
) -> list[str]:
    problems: list[str] = []
    for attr, params in methods:
        member = inspect.getattr_static(cls, attr, None)
        if member is None or not callable(member):
            problems.append(f"{name}.{attr} is gone or no longer a method")
            continue
        parameters = inspect.signature(member).parameters.values()
        if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
            continue  # a decorator's (*args, **kwargs) (verl's GPUMemoryLogger keeps no __wrapped__)
        names = tuple(p.name for p in parameters)[: len(params)]
        if names != params:
            problems.append(
                f"{name}.{attr} now takes ({', '.join(names)}), expected ({', '.join(params)})"
            )
    return problems


def contract_problems(target: Any | None = None) -> list[str]:
    """Every mismatch between the installed verl and what shardscale.verl relies on.

    The installed series picks the path (the FSDP engine on verl 0.9, the legacy
    actor and its checkpoint manager on verl 0.7); a release outside both is the
    one problem. With ``target`` (an engine or an actor), its instance
    attributes are checked too.
    """
    try:
        kind = installed_kind()
    except VerlContractError as exc:
        return [str(exc)]
    problems: list[str] = []
    attributes: tuple[str, ...]
    if kind == "engine":
        problems += _method_problems(_engine_class(), "FSDPEngine", _ENGINE_METHODS)
        attributes, owner = _ENGINE_ATTRIBUTES, "FSDPEngine"
        config_name, clip_name = "optimizer_config", "clip_grad"
    else:
        problems += _method_problems(_actor_class(), "DataParallelPPOActor", _ACTOR_METHODS)
        problems += _method_problems(_manager_class(), "FSDPCheckpointManager", _MANAGER_METHODS)
        attributes, owner = _ACTOR_ATTRIBUTES, "DataParallelPPOActor"
        config_name, clip_name = "config", "grad_clip"
    if target is not None:
        problems.extend(
            f"{owner} instances no longer have .{name}"
            for name in attributes
            if not hasattr(target, name)
        )
        config = getattr(target, config_name, None)
        if config is not None and not hasattr(config, clip_name):
            problems.append(f"the {owner}'s {config_name} no longer has .{clip_name}")
    if problems:
        tested = TESTED_VERL if kind == "engine" else TESTED_VERL_LEGACY
        problems.append(f"(installed verl {_installed()}; tested {tested})")
    return problems


def check_verl(target: Any | None = None) -> None:
    """Raise :class:`VerlContractError` listing every mismatch (see :func:`contract_problems`)."""
    problems = contract_problems(target)
    if problems:
        raise VerlContractError(
            "shardscale.verl cannot install itself: verl changed what it relies on:\n  "
            + "\n  ".join(problems)
            + f"\nIt supports: {_supported()}. Install one of those, or a shardscale-verl "
            "release that supports your verl."
        )
