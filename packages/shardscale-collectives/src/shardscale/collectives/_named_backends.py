"""``gloo`` and ``nccl``: the ``c10d`` backend plus a check that the group really uses that library.

Naming a library is a promise about performance and placement (nccl: CUDA
tensors on a GPU interconnect). When the group uses something else, these
backends refuse with an error saying what they found and how to fix it, rather
than silently running on another library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from shardscale.collectives._c10d import C10dBackend, WorkHandle, require_initialized
from shardscale.core import BackendUnavailableError, ReduceOp

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["GlooBackend", "NcclBackend", "group_backend_for"]


def group_backend_for(group: ProcessGroup | None, device_type: str) -> str:
    """The torch.distributed backend ``group`` uses for tensors on ``device_type``.

    A group may map devices to different libraries (``"cpu:gloo,cuda:nccl"``);
    when the device is not listed, the whole configuration string is returned.
    """
    import torch.distributed as dist

    config = str(dist.get_backend_config(group))
    if ":" not in config:
        return config or str(dist.get_backend(group))
    mapping = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    return mapping.get(device_type, config)


class _CheckedC10dBackend(C10dBackend):
    #: The torch.distributed backend the group must use.
    library: ClassVar[str]
    #: Only ever chosen by name: the automatic choice is plain ``c10d``.
    automatic_priority: ClassVar[int | None] = None

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp, group: ProcessGroup | None
    ) -> WorkHandle:
        """Check the group's library for ``tensor``'s device, then reduce as ``c10d`` does."""
        if isinstance(tensor, torch.Tensor):
            self.check_group(group, device_type=tensor.device.type)
        return super().all_reduce(tensor, op=op, group=group)

    def check_group(self, group: ProcessGroup | None, *, device_type: str) -> None:
        """Raise :class:`BackendUnavailableError` unless ``group`` uses this library for the device."""
        require_initialized(self.name)
        found = group_backend_for(group, device_type)
        if found != self.library:
            which = "the default process group" if group is None else "this process group"
            raise BackendUnavailableError(
                f"the {self.name!r} shardscale backend needs a process group using "
                f"{self.library}, but {which} uses {found!r} for {device_type} tensors. "
                f"Create the group with backend={self.library!r} "
                f"(torch.distributed.init_process_group({self.library!r}) or new_group(..., "
                f"backend={self.library!r})), or select the 'c10d' backend, which reduces "
                "over any torch.distributed backend."
            )


class GlooBackend(_CheckedC10dBackend):
    """``c10d`` restricted to gloo process groups."""

    name: ClassVar[str] = "gloo"
    library: ClassVar[str] = "gloo"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why gloo cannot run here, or ``None``."""
        import torch.distributed as dist

        if not dist.is_available():
            return "torch.distributed is not available in this torch build"
        if not dist.is_gloo_available():
            return "Gloo is not available in this torch build"
        return None


class NcclBackend(_CheckedC10dBackend):
    """``c10d`` restricted to NCCL process groups and CUDA tensors."""

    name: ClassVar[str] = "nccl"
    library: ClassVar[str] = "nccl"

    def check_group(self, group: ProcessGroup | None, *, device_type: str) -> None:
        """Refuse non-CUDA tensors, then check the group as the base class does."""
        if device_type != "cuda":
            raise BackendUnavailableError(
                f"the 'nccl' shardscale backend reduces CUDA tensors only, got a {device_type} "
                "tensor; keep the scaler on 'cuda', or select 'gloo'/'c10d' for CPU tensors"
            )
        super().check_group(group, device_type=device_type)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why NCCL cannot run here, or ``None``."""
        import torch.distributed as dist

        if not dist.is_available():
            return "torch.distributed is not available in this torch build"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        if not dist.is_nccl_available():
            return "NCCL is not available in this torch build"
        return None
