"""Test helpers for users and for shardscale's own tests.

- :class:`HostReadRecorder`: prove that a step never syncs (below);
- :func:`recording_steps`: collect every :class:`StepRecord` the registry's observers see;
- :func:`counting_gloo_group`: a process group whose torch.distributed backend is gloo with
  its all-reduce calls counted (:class:`CountingGlooGroup`), a custom backend as users
  register them;
- :class:`RecordingKernels`: show that a front end computes with the stats kernels its
  scaler names.

:class:`HostReadRecorder` is a ``TorchDispatchMode`` that records every aten op that makes
the host wait for a device value (``item()``/``float()``/``bool()`` and friends). Wrap one
training step in it; an empty :attr:`HostReadRecorder.seen` means the step queued its work
and returned without reading a device value. On a CPU run "device" and host are one
memory, so the recorder flags the *op*, which is what would synchronise on a GPU.

:class:`RecordingKernels` are stats kernels that record which of their methods ran, ranked
below every built-in so that they run only when named (``kernels="recording"``). Register
one in a registry and hand that registry to a scaler: a front end that clips without the
scaler's configuration computes its norm with other kernels, and ``calls`` shows it.
``tolist()`` and ``copy_`` into a host tensor are not in the set: the first is no dispatcher
op at all, the second is how asynchronous, pinned device-to-host copies are written.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from shardscale.core._foreach_kernels import ForeachKernels
from shardscale.core._hookspecs import hookimpl
from shardscale.core._protocols import StepRecord
from shardscale.core._registry import get_registry

if TYPE_CHECKING:
    from shardscale.core._registry import Registry

__all__ = [
    "COUNTING_GLOO",
    "HOST_READ_OPS",
    "CountingGlooGroup",
    "HostReadRecorder",
    "StepRecorder",
    "counting_gloo_group",
    "recording_steps",
    "RecordingKernels",
]

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


class StepRecorder:
    """A ``shardscale_on_step`` observer that keeps every record, in order, in :attr:`records`."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    @hookimpl
    def shardscale_on_step(self, record: StepRecord) -> None:
        """Keep ``record``."""
        self.records.append(record)


@contextmanager
def recording_steps(
    registry: Registry | None = None, *, name: str = "testing-step-recorder"
) -> Iterator[StepRecorder]:
    """Register a :class:`StepRecorder` for the ``with`` block, and unregister it after.

    ``with recording_steps() as rec: ...`` then ``rec.records`` holds what every
    ``scaler.update()`` in the block reported.
    """
    reg = registry if registry is not None else get_registry()
    recorder = StepRecorder()
    registered = reg.register(recorder, name=name)
    try:
        yield recorder
    finally:
        reg.unregister(registered)


#: The torch.distributed backend name :func:`counting_gloo_group` registers.
COUNTING_GLOO = "sscountinggloo"


class CountingGlooGroup(dist.ProcessGroup):
    """A torch.distributed backend written in Python: gloo underneath, all-reduces counted.

    :attr:`calls` counts the all-reduce calls of every instance in this
    process; read it before and after the code under test.
    """

    calls: ClassVar[int] = 0

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) overload
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:  # type: ignore[override]
        """Count the call and let gloo do it."""
        type(self).calls += 1
        work: dist.Work = self._gloo.allreduce(tensors, opts)  # type: ignore[attr-defined]
        return work

    def getBackendName(self) -> str:
        """The name this backend is registered under."""
        return COUNTING_GLOO


def counting_gloo_group() -> dist.ProcessGroup:
    """A new group of every rank over :class:`CountingGlooGroup` (call it on every rank).

    The backend is registered with torch.distributed on first use; the
    default process group must already be initialized.
    """
    if not hasattr(dist.Backend, COUNTING_GLOO.upper()):
        dist.Backend.register_backend(COUNTING_GLOO, CountingGlooGroup, devices=["cpu"])
    group: dist.ProcessGroup = dist.new_group(backend=COUNTING_GLOO)
    return group


class RecordingKernels(ForeachKernels):
    """The ``foreach`` kernels under the name ``"recording"``, noting each call in :attr:`calls`.

    ``calls`` lists ``"unscale"`` (``unscale_and_check_``: a scaler's unscale),
    ``"norms"`` (``tensor_norms``: a norm, as a clip computes) and ``"mul"``
    (``mul_``: a clip's multiply) in the order they ran. The object is its own
    plugin::

        kernels = RecordingKernels()
        name = get_registry().register(kernels, name="recording-kernels")
        try:
            scaler = ShardedGradScaler("cpu", kernels="recording")
            ...
        finally:
            get_registry().unregister(name)
    """

    name: ClassVar[str] = "recording"
    priority: ClassVar[int] = -100  # never the automatic choice

    def __init__(self) -> None:
        self.calls: list[str] = []

    @hookimpl
    def shardscale_stats_kernels(self) -> list[ForeachKernels]:
        """The plugin hook: these kernels."""
        return [self]

    def unscale_and_check_(
        self, tensors: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
    ) -> None:
        """Record ``"unscale"``, then the ``foreach`` unscale."""
        self.calls.append("unscale")
        super().unscale_and_check_(tensors, found_inf, inv_scale)

    def tensor_norms(self, tensors: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        """Record ``"norms"``, then the ``foreach`` norms."""
        self.calls.append("norms")
        return super().tensor_norms(tensors, norm_type)

    def mul_(self, tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
        """Record ``"mul"``, then the ``foreach`` multiply."""
        self.calls.append("mul")
        super().mul_(tensors, coef)
