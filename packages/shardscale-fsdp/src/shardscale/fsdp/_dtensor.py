"""The adapter for DTensor parameters: FSDP2 ``fully_shard``, HSDP, FSDP+TP, TP alone, ``replicate``."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import torch

from shardscale.core import AdapterContext, GradShard, LayoutError
from shardscale.fsdp._mesh_replicas import ReplicaStatus, replica_status

__all__ = ["DTENSOR_PRIORITY", "DTensorAdapter"]

#: Above the plain-tensor adapter (0), below FSDP1 (which knows more about its parameters).
DTENSOR_PRIORITY = 20
_SPEC = operator.attrgetter("_spec")
_MESH = operator.attrgetter("mesh")
_PLACEMENTS = operator.attrgetter("placements")
#: Layouts one adapter remembers (a model has a handful; tests build many meshes).
_LAYOUTS_KEPT = 256


def _dtensor_type() -> type[Any] | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        return None
    return DTensor


class DTensorAdapter:
    """Describes gradients of ``DTensor`` parameters on any device mesh.

    ``local`` is the gradient's local shard (read for statistics, scaled in
    place). It counts towards global sums only on the rank at coordinate 0 of
    every mesh dim whose placement is ``Replicate`` and, when the mesh is a
    slice of a larger root mesh, at coordinate 0 of every other root dim
    except those named in ``distinct_dims`` (see
    ``shardscale.fsdp._mesh_replicas``). ``ranks`` are the global ranks of the
    gradient's mesh. Mixed-precision reduce dtypes and CPU-offloaded gradients
    need nothing special: the local shard simply has that dtype or device.
    ``Partial`` gradients are refused with a :class:`~shardscale.core.LayoutError`.
    """

    name: ClassVar[str] = "dtensor"
    priority: ClassVar[int] = DTENSOR_PRIORITY
    #: Its answer depends only on the gradient's layout and the step's context (the step plan).
    stable_layout: ClassVar[bool] = True

    def __init__(self) -> None:
        self._dtensor = _dtensor_type()
        # (id(mesh), placements, distinct dims) -> (mesh, status): thousands of FSDP2 gradients
        # share a few layouts. The mesh is kept, so its id cannot be reused while remembered.
        self._layouts: dict[tuple[int, Any, frozenset[str]], tuple[Any, ReplicaStatus]] = {}

    def claims(self, param: torch.Tensor) -> bool:
        """Any ``DTensor`` parameter (FSDP2 turns every managed parameter into one)."""
        return self._dtensor is not None and isinstance(param, self._dtensor)

    def claims_type(self, kind: type) -> bool:
        """Every parameter of a DTensor class, and none of another (the registry's shortcut)."""
        return self._dtensor is not None and issubclass(kind, self._dtensor)

    def layout_keys(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], ctx: AdapterContext
    ) -> list[Hashable] | None:
        """Per gradient, what :meth:`describe`'s ``counts`` and ``ranks`` rest on.

        The identities of its spec's mesh and placements, packed in one int
        (``describe`` reads nothing else of the gradient, and both live as
        long as the gradients do), with C-level maps only; None when a
        gradient is no DTensor (``describe`` names that problem).
        """
        del params, ctx
        if self._dtensor is None or not all(
            issubclass(kind, self._dtensor) for kind in set(map(type, grads))
        ):
            return None
        specs = list(map(_SPEC, grads))
        # One exact int per gradient, id(mesh) << 64 | id(placements): no tuple per gradient
        # (10^4 short-lived tuples set off garbage collections of the whole heap).
        meshes = map(operator.lshift, map(id, map(_MESH, specs)), itertools.repeat(64))
        return list(map(operator.or_, meshes, map(id, map(_PLACEMENTS, specs))))

    def describe(self, param: torch.Tensor, grad: torch.Tensor, ctx: AdapterContext) -> GradShard:
        """The grad's local shard, whether this copy counts, and the mesh's ranks."""
        assert self._dtensor is not None  # claims() said yes
        if not isinstance(grad, self._dtensor):
            raise LayoutError(
                f"a DTensor parameter of shape {tuple(param.shape)} has a plain "
                f"{type(grad).__name__} gradient; shardscale cannot tell which ranks hold "
                "which part of it. Assign gradients as DTensors with the parameter's mesh "
                "(DTensor.from_local(local_grad, param.device_mesh, param.placements))."
            )
        spec = grad._spec
        key = (id(spec.mesh), spec.placements, ctx.distinct_dims)
        known = self._layouts.get(key)
        if known is None:
            import torch.distributed as dist

            status = replica_status(
                spec.mesh,
                spec.placements,
                ctx.distinct_dims,
                global_rank=dist.get_rank() if dist.is_initialized() else 0,
            )
            if len(self._layouts) >= _LAYOUTS_KEPT:
                self._layouts.clear()
            known = self._layouts[key] = (spec.mesh, status)
        status = known[1]
        local: torch.Tensor = grad._local_tensor
        return GradShard(local=local, counts=status.counts, ranks=status.ranks)
