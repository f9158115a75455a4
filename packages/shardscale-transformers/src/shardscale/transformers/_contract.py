"""What shardscale.transformers relies on in the 🤗 Trainer, checked before anything is changed.

[Note: the Trainer's contract]
The Trainer runs on an ``Accelerator`` (``trainer.accelerator``, built in
``Trainer.__init__``, prepared inside ``train()``), so the scaler, the skip
signal that gates ``lr_scheduler.step()``, ``scaler.pt`` in checkpoints and the
common clipping path all come from ``shardscale.accelerate.use_shardscale``.
The Trainer adds two private methods of its own around clipping:
``_clip_grad_norm(model)`` and ``_get_grad_norm(model, grad_norm)``, which
bypass ``accelerator.clip_grad_norm_`` when gradients live on several device
meshes (and then neither unscale nor reach the scaler). ``use_shardscale``
shadows both on the one Trainer it is given; the callback it adds reads the
prepared optimizer from the callback arguments and records skips in
``TrainerState``. :func:`check_transformers` raises
:class:`TransformersContractError` naming whatever of this moved, before any
object is touched, instead of training with a silently bypassed scaler.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = [
    "TESTED_TRANSFORMERS",
    "TransformersContractError",
    "check_transformers",
    "transformers_contract_problems",
]

#: The transformers release the tests run (noxfile FRAMEWORKS pins it).
TESTED_TRANSFORMERS = "5.24.0"

# (attribute of Trainer, the leading parameter names it must accept)
_TRAINER_METHODS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("_clip_grad_norm", ("self", "model")),
    ("_get_grad_norm", ("self", "model", "grad_norm")),
    ("add_callback", ("self", "callback")),
    ("log", ("self", "logs")),
    ("_save_scaler", ("self", "output_dir")),
    ("_load_scaler", ("self", "checkpoint")),
)
# Callback events the shardscale callback implements, with the keyword it reads.
_CALLBACK_EVENTS = ("on_train_begin", "on_step_end", "on_log")
# Instance attributes a Trainer sets in __init__ that use_shardscale reads.
_TRAINER_ATTRIBUTES = ("accelerator", "args", "callback_handler", "state")


class TransformersContractError(RuntimeError):
    """The installed transformers no longer has what shardscale.transformers overrides or reads."""


def transformers_contract_problems(trainer: Any | None = None) -> list[str]:
    """Every mismatch between the installed transformers and what shardscale.transformers uses.

    With ``trainer``, its instance attributes are checked too.
    """
    import transformers
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState, TrainerState

    problems: list[str] = []
    for attr, params in _TRAINER_METHODS:
        member = inspect.getattr_static(Trainer, attr, None)
        if member is None or not callable(member):
            problems.append(f"Trainer.{attr} is gone")
            continue
        names = tuple(inspect.signature(member).parameters)[: len(params)]
        if names != params:
            problems.append(
                f"Trainer.{attr} now takes ({', '.join(names)}), expected ({', '.join(params)})"
            )
    problems.extend(
        f"TrainerCallback.{event} is gone"
        for event in _CALLBACK_EVENTS
        if not callable(getattr(TrainerCallback, event, None))
    )
    if not callable(getattr(ExportableState, "state", None)):
        problems.append("transformers.trainer_callback.ExportableState.state is gone")
    if "stateful_callbacks" not in getattr(TrainerState, "__dataclass_fields__", {}):
        problems.append("TrainerState.stateful_callbacks is gone")
    if trainer is not None:
        problems.extend(
            f"Trainer instances no longer have .{name}"
            for name in _TRAINER_ATTRIBUTES
            if not hasattr(trainer, name)
        )
        handler = getattr(trainer, "callback_handler", None)
        if handler is not None and not isinstance(getattr(handler, "callbacks", None), list):
            problems.append("Trainer.callback_handler.callbacks is no longer a list")
    if problems:
        problems.append(
            f"(installed transformers {transformers.__version__}; tested {TESTED_TRANSFORMERS})"
        )
    return problems


def check_transformers(trainer: Any | None = None) -> None:
    """Raise :class:`TransformersContractError` listing every mismatch (see
    :func:`transformers_contract_problems`)."""
    problems = transformers_contract_problems(trainer)
    if problems:
        raise TransformersContractError(
            "shardscale.transformers cannot install itself: transformers changed what it "
            "relies on:\n  "
            + "\n  ".join(problems)
            + f"\nInstall transformers=={TESTED_TRANSFORMERS}, or a shardscale-transformers "
            "release that supports your transformers."
        )
