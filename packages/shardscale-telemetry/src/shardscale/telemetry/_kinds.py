"""The observer kinds telemetry knows by name, in one table.

``SHARDSCALE_TELEMETRY`` names observers by kind (``jsonl:PATH``), ``enable()``
checks the observers it is given against the kinds' rules, ``shardscale
plugins`` lists the kinds with whether each can run here, and the docs' table
of the variable's syntax is checked against this one
(``tests/test_kinds.py``). A new kind is one row here.

[Note: one writer per file]
A kind whose target is a file or a folder (``jsonl``, ``tensorboard``) must
not be shared by two writing ranks: their lines would interleave and one
rank's file replace the other's. So when more than one rank may write
(``ranks=all``, or several ranks), the target must contain ``{rank}``. The
variable and ``enable()`` refuse the same way, with the same text
(:func:`per_rank_problem`). W&B runs are per rank already.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from shardscale.telemetry._jsonl import JsonlObserver
from shardscale.telemetry._tensorboard import TensorBoardObserver, tensorboard_unavailable_reason
from shardscale.telemetry._wandb import WandbObserver, wandb_unavailable_reason

if TYPE_CHECKING:
    from shardscale.telemetry._observer import Observer

__all__ = [
    "OBSERVER_KINDS",
    "ObserverKind",
    "kind_of",
    "observer_kinds",
    "per_rank_problem",
]


@dataclass(frozen=True, slots=True)
class ObserverKind:
    """One kind of observer: its name, what follows ``:`` in the variable, and its class.

    ``target`` is what ``NAME:TARGET`` names (a ``file``, a ``folder`` or a
    W&B ``project``); ``required`` whether it must be given;
    ``description`` the line the docs show for it.
    """

    name: str
    cls: type
    target: Literal["file", "folder", "project"]
    required: bool
    placeholder: str
    example: str
    description: str
    unavailable_reason: Callable[[], str | None]

    @property
    def spelling(self) -> str:
        """How the variable writes it: ``jsonl:PATH``, or ``wandb or wandb:PROJECT``."""
        full = f"{self.name}:{self.placeholder}"
        return full if self.required else f"{self.name} or {full}"

    @property
    def per_rank(self) -> bool:
        """Whether each writing rank needs its own target (see [Note: one writer per file])."""
        return self.target in ("file", "folder")

    def build(self, target: str | None) -> Observer:
        """The observer for ``target`` (creates nothing on disk)."""
        observer: Observer = self.cls(target)
        return observer

    def ranked(self, target: str) -> str:
        """``target`` made per rank: ``steps.rank{rank}.jsonl``, ``runs/tb/rank{rank}``."""
        if self.target == "file":
            head, dot, ext = target.rpartition(".")
            if dot and head and "/" not in ext:
                return f"{head}.rank{{rank}}.{ext}"
            return f"{target}.rank{{rank}}"
        return f"{target.rstrip('/')}/rank{{rank}}"


#: Every kind, by the name the variable uses.
OBSERVER_KINDS: dict[str, ObserverKind] = {
    kind.name: kind
    for kind in (
        ObserverKind(
            "jsonl",
            JsonlObserver,
            "file",
            True,
            "PATH",
            "runs/steps.jsonl",
            "one JSON line per step in the file `PATH` (replaced at the start of the run)",
            lambda: None,
        ),
        ObserverKind(
            "tensorboard",
            TensorBoardObserver,
            "folder",
            True,
            "DIR",
            "runs/tb",
            "TensorBoard event files in the folder `DIR`",
            tensorboard_unavailable_reason,
        ),
        ObserverKind(
            "wandb",
            WandbObserver,
            "project",
            False,
            "PROJECT",
            "my-project",
            "a W&B run (project: `PROJECT`, else `$WANDB_PROJECT`, else `shardscale`)",
            wandb_unavailable_reason,
        ),
    )
}


def kind_of(observer: object) -> ObserverKind | None:
    """The kind ``observer`` is an instance of (``None``: your own observer)."""
    return next((k for k in OBSERVER_KINDS.values() if isinstance(observer, k.cls)), None)


def per_rank_problem(kind: ObserverKind, target: str, ranks: str) -> str | None:
    """Why several ranks cannot write ``target`` (``None``: they can); ``ranks`` as written.

    The one text for the variable and ``enable()`` (see [Note: one writer per file]).
    """
    if not kind.per_rank or "{rank}" in target:
        return None
    return (
        f"with ranks={ranks} every writing rank needs its own {kind.target}, so the "
        f"{kind.name} {kind.target} {target!r} must contain {{rank}} "
        f"(e.g. {kind.ranked(target)!r})"
    )


def observer_kinds() -> dict[str, str | None]:
    """Each observer kind, and why it cannot run here (``None``: it can)."""
    return {name: kind.unavailable_reason() for name, kind in OBSERVER_KINDS.items()}
