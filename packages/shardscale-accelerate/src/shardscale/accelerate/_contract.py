"""What shardscale.accelerate relies on in Accelerate, checked before anything is changed.

[Note: why a contract check]
Accelerate offers no hook to choose the loss scaler's class or how
``clip_grad_norm_`` and ``step_was_skipped`` work. ``use_shardscale`` therefore
sets the public ``Accelerator.scaler`` attribute and overrides five methods on
ONE ``Accelerator`` instance (``prepare_optimizer``, ``prepare_scheduler``,
``backward``, ``unscale_gradients``, ``clip_grad_norm_``), and gives the
``AcceleratedOptimizer`` objects it prepares a subclass that steps through the
scaler and reads the skip flag from it, and the ``AcceleratedScheduler``
objects one that defers the skip check (it reads the scheduler's
``scheduler``, ``optimizers``, ``split_batches``, ``step_with_optimizer`` and
``gradient_state``, the names of its ``__init__``). Each of those
relies on a name and a signature below. When Accelerate changes one of them,
:func:`check_accelerate` raises :class:`AccelerateContractError` naming it,
before any object is touched, instead of training with a silently bypassed
scaler. The versions this was tested with are in :data:`TESTED_ACCELERATE`.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["AccelerateContractError", "TESTED_ACCELERATE", "check_accelerate", "contract_problems"]

#: The Accelerate release the tests run (noxfile FRAMEWORKS pins it).
TESTED_ACCELERATE = "1.15.0"

# (class name, attribute, the leading parameter names it must accept, or None for a property)
_METHODS: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("Accelerator", "prepare_optimizer", ("self", "optimizer", "device_placement")),
    ("Accelerator", "prepare_scheduler", ("self", "scheduler")),
    ("Accelerator", "unscale_gradients", ("self", "optimizer")),
    ("Accelerator", "clip_grad_norm_", ("self", "parameters", "max_norm", "norm_type")),
    ("Accelerator", "backward", ("self", "loss")),
    ("Accelerator", "save_state", ("self", "output_dir")),
    ("Accelerator", "load_state", ("self", "input_dir")),
    ("Accelerator", "optimizer_step_was_skipped", None),
    ("AcceleratedOptimizer", "__init__", ("self", "optimizer", "device_placement", "scaler")),
    ("AcceleratedOptimizer", "step", ("self", "closure")),
    ("AcceleratedOptimizer", "step_was_skipped", None),
    ("AcceleratedScheduler", "__init__",
     ("self", "scheduler", "optimizers", "step_with_optimizer", "split_batches")),
    ("AcceleratedScheduler", "step", ("self",)),
    ("AcceleratedScheduler", "get_last_lr", ("self",)),
    ("AcceleratedScheduler", "state_dict", ("self",)),
    ("AcceleratedScheduler", "load_state_dict", ("self", "state_dict")),
)  # fmt: skip
# Instance attributes an Accelerator sets in __init__ that the override reads or writes.
_ACCELERATOR_ATTRIBUTES = ("scaler", "scaler_handler", "_optimizers", "distributed_type",
                           "mixed_precision", "device")  # fmt: skip


class AccelerateContractError(RuntimeError):
    """The installed Accelerate no longer has what shardscale.accelerate overrides or reads."""


def contract_problems(accelerator: Any | None = None) -> list[str]:
    """Every mismatch between the installed Accelerate and what shardscale.accelerate relies on.

    With ``accelerator``, its instance attributes are checked too.
    """
    import accelerate
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler

    classes: dict[str, type] = {
        "Accelerator": Accelerator,
        "AcceleratedOptimizer": AcceleratedOptimizer,
        "AcceleratedScheduler": AcceleratedScheduler,
    }
    problems: list[str] = []
    for cls_name, attr, params in _METHODS:
        cls = classes[cls_name]
        member = inspect.getattr_static(cls, attr, None)
        if member is None:
            problems.append(f"{cls_name}.{attr} is gone")
            continue
        if params is None:
            if not isinstance(member, property):
                problems.append(f"{cls_name}.{attr} is no longer a property")
            continue
        if not callable(member):
            problems.append(f"{cls_name}.{attr} is no longer a method")
            continue
        names = tuple(inspect.signature(member).parameters)[: len(params)]
        if names != params:
            problems.append(
                f"{cls_name}.{attr} now takes ({', '.join(names)}), expected ({', '.join(params)})"
            )
    if accelerator is not None:
        problems.extend(
            f"Accelerator instances no longer have .{name}"
            for name in _ACCELERATOR_ATTRIBUTES
            if not hasattr(accelerator, name)
        )
        if hasattr(accelerator, "_optimizers") and not isinstance(accelerator._optimizers, list):
            problems.append("Accelerator._optimizers is no longer a list")
    if problems:
        problems.append(
            f"(installed accelerate {accelerate.__version__}; tested {TESTED_ACCELERATE})"
        )
    return problems


def check_accelerate(accelerator: Any | None = None) -> None:
    """Raise :class:`AccelerateContractError` listing every mismatch (see :func:`contract_problems`)."""
    problems = contract_problems(accelerator)
    if problems:
        raise AccelerateContractError(
            "shardscale.accelerate cannot install itself: Accelerate changed what it relies on:\n  "
            + "\n  ".join(problems)
            + f"\nInstall accelerate=={TESTED_ACCELERATE}, or a shardscale-accelerate release that "
            "supports your Accelerate."
        )
