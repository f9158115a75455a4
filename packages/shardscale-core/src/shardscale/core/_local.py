"""The ``local`` backend: a single process, so every reduction is the identity."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from shardscale.core._protocols import CompletedHandle, Handle, ReduceOp

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = ["LocalBackend"]


class LocalBackend:
    """Single-process backend: no communication, world size 1.

    The registry picks it automatically when ``torch.distributed`` is not
    initialized. Used inside a multi-rank run it would let ranks diverge, so it
    refuses a group larger than one rank.
    """

    name: ClassVar[str] = "local"

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp, group: ProcessGroup | None
    ) -> Handle:
        """Return at once: the local value already is the global one."""
        del tensor, op
        import torch.distributed as dist

        from shardscale.core._errors import BackendUnavailableError

        multi_rank = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if group is None and multi_rank:
            raise BackendUnavailableError(
                f"the 'local' backend was chosen (backend='local' or $SHARDSCALE_BACKEND) in a "
                f"run of {dist.get_world_size()} ranks: it reduces nothing, so ranks would "
                f"decide differently and diverge. {_multi_rank_hint()}"
            )
        if self.world_size(group) != 1:
            raise BackendUnavailableError(
                "the 'local' backend cannot reduce over a process group of "
                f"{self.world_size(group)} ranks: ranks would disagree. {_multi_rank_hint()}"
            )
        return CompletedHandle()

    def world_size(self, group: ProcessGroup | None) -> int:
        """1, unless a real process group is passed in."""
        if group is None:
            return 1
        import torch.distributed as dist

        return int(dist.get_world_size(group))

    def rank(self, group: ProcessGroup | None) -> int:
        """Always 0."""
        del group
        return 0

    def group_ranks(self, group: ProcessGroup | None) -> tuple[int, ...]:
        """``(0,)``: the only rank."""
        del group
        return (0,)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """The local backend runs everywhere."""
        return None


def _multi_rank_hint() -> str:
    """How to get a backend that reduces across ranks, from what is installed (core names none)."""
    from shardscale.core._errors import ShardscaleError
    from shardscale.core._registry import get_registry

    try:
        choice = get_registry()._automatic_backend(True).rpartition(":")[2]
    except ShardscaleError:
        return (
            "Install a plugin with a backend that reduces across ranks ('shardscale plugins' "
            "lists what is installed) and leave the backend unset, or name that backend."
        )
    return f"Leave the backend unset (the automatic choice across ranks is {choice!r}) or name one."
