"""What shardscale.verl relies on in verl's FSDP engine, checked before anything is changed.

[Note: why a contract check]
verl's FSDP engine (``verl.workers.engine.fsdp.transformer_impl.FSDPEngine``)
has no option that chooses its loss scaler, its clipping or what happens to the
learning-rate scheduler on a skipped step. ``use_shardscale`` therefore sets
the engine's ``scaler`` attribute (which verl's own ``forward_backward_batch``
reads to scale the loss) and shadows five of its methods on ONE engine
instance: ``optimizer_step``, ``train_batch``, ``lr_scheduler_step``,
``save_checkpoint`` and ``load_checkpoint`` (each calls verl's own method
where it only adds something). Each relies on a name and a signature below.
When verl changes one of them, :func:`check_verl` raises
:class:`VerlContractError` naming it, before the engine is touched, instead of
training with a silently bypassed scaler. The release this was tested with is
:data:`TESTED_VERL`.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["TESTED_VERL", "VerlContractError", "check_verl", "contract_problems"]

#: The verl release the tests run (noxfile VERL pins it).
TESTED_VERL = "0.9.1"

# (attribute of FSDPEngine, the leading parameter names it must accept)
_METHODS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("initialize", ("self",)),
    ("forward_backward_batch", ("self", "data", "loss_function", "forward_only")),
    ("optimizer_step", ("self",)),
    ("train_batch", ("self", "data", "loss_function")),
    ("lr_scheduler_step", ("self",)),
    ("save_checkpoint", ("self", "local_path", "hdfs_path", "global_step", "max_ckpt_to_keep")),
    ("load_checkpoint", ("self", "local_path", "hdfs_path", "del_local_after_load")),
    ("is_mp_src_rank_with_outputs", ("self",)),
)
# Instance attributes an initialized engine has that use_shardscale reads or replaces.
_ENGINE_ATTRIBUTES = ("scaler", "optimizer", "lr_scheduler", "module", "optimizer_config")


class VerlContractError(RuntimeError):
    """The installed verl no longer has what shardscale.verl replaces or reads."""


def _engine_class() -> type:
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    cls: type = FSDPEngine
    return cls


def contract_problems(engine: Any | None = None) -> list[str]:
    """Every mismatch between the installed verl and what shardscale.verl relies on.

    With ``engine``, its instance attributes are checked too.
    """
    import verl

    cls = _engine_class()
    problems: list[str] = []
    for attr, params in _METHODS:
        member = inspect.getattr_static(cls, attr, None)
        if member is None or not callable(member):
            problems.append(f"FSDPEngine.{attr} is gone or no longer a method")
            continue
        names = tuple(inspect.signature(member).parameters)[: len(params)]
        if names != params:
            problems.append(
                f"FSDPEngine.{attr} now takes ({', '.join(names)}), expected ({', '.join(params)})"
            )
    if engine is not None:
        problems.extend(
            f"FSDPEngine instances no longer have .{name}"
            for name in _ENGINE_ATTRIBUTES
            if not hasattr(engine, name)
        )
        config = getattr(engine, "optimizer_config", None)
        if config is not None and not hasattr(config, "clip_grad"):
            problems.append("the engine's optimizer_config no longer has .clip_grad")
    if problems:
        problems.append(f"(installed verl {verl.__version__}; tested {TESTED_VERL})")
    return problems


def check_verl(engine: Any | None = None) -> None:
    """Raise :class:`VerlContractError` listing every mismatch (see :func:`contract_problems`)."""
    problems = contract_problems(engine)
    if problems:
        raise VerlContractError(
            "shardscale.verl cannot install itself: verl changed what it relies on:\n  "
            + "\n  ".join(problems)
            + f"\nInstall verl=={TESTED_VERL}, or a shardscale-verl release that supports "
            "your verl."
        )
