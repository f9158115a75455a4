"""Test helpers for users and for shardscale's own tests: prove that a step never syncs.

:class:`HostReadRecorder` is a ``TorchDispatchMode`` that records every aten op that makes
the host wait for a device value (``item()``/``float()``/``bool()`` and friends). Wrap one
training step in it; an empty :attr:`HostReadRecorder.seen` means the step queued its work
and returned without reading a device value. On a CPU run "device" and host are one
memory, so the recorder flags the *op*, which is what would synchronise on a GPU.
``tolist()`` and ``copy_`` into a host tensor are not in the set: the first is no dispatcher
op at all, the second is how asynchronous, pinned device-to-host copies are written.
"""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_READ_OPS", "HostReadRecorder"]

#: aten ops whose result the host must wait for (the schema names a dispatch mode sees).
HOST_READ_OPS: frozenset[str] = frozenset(
    {
        "aten::_local_scalar_dense",  # behind item(), float(), int()
        "aten::is_nonzero",  # behind bool()
        "aten::item",
        "aten::equal",
        "aten::allclose",
    }
)


class HostReadRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Record each host-reading op that runs inside ``with HostReadRecorder() as rec:``.

    ``rec.seen`` lists the ops' schema names in the order they ran.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        if name in HOST_READ_OPS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))
