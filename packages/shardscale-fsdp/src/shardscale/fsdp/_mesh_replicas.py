"""Which copy of a DTensor's local shard counts towards global sums.

[Note: replicas of a DTensor shard]
A rank's local shard of a DTensor gradient has identical copies on other ranks
in two ways:

1. along every dimension of the DTensor's own mesh whose placement is
   ``Replicate`` (HSDP's replicate dim, a TP-replicated bias);
2. when the mesh is a slice of a larger root mesh, along the root's other
   dimensions: a non-TP parameter of an FSDP+TP model lives on the ``dp`` slice
   and every ``tp`` rank holds the same ``dp`` shard. Dimensions the user names
   in ``distinct_dims`` (pipeline stages) hold *different* parameters there and
   are never replicas.

Only the copy at coordinate 0 of each replicated dimension counts, so a SUM
over all ranks sees each element exactly once.

For (2) we work with ranks rather than dimension names, because a slice may be
a flattened combination of root dims (``dp_shard_cp``) or the root may be a
coarse 1-D world mesh that was unflattened into named views. The ranks of the
slice that holds this rank form a *translate* of the slice inside the root.
Translates whose ranks share the same coordinates on the distinct root dims
are replicas of each other; of those, the translate holding the smallest rank
is the one that counts. With named root dims and no distinct dims this is
exactly "coordinate 0 on every root dim outside the slice". A distinct dim
must be a named dim of the root mesh to be recognised; ``"*"`` makes every root
dim distinct (each slice translate holds its own parameters).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardscale.core import LayoutError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["ALL_DIMS", "ReplicaStatus", "counting_translate", "replica_status"]

#: In ``distinct_dims``: every rank (or every root dim) holds its own parameters.
ALL_DIMS = "*"


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """Whether this rank's copy counts, and which global ranks hold parts of the tensor."""

    counts: bool
    ranks: frozenset[int] | None


def replica_status(
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    distinct_dims: frozenset[str],
    *,
    global_rank: int,
) -> ReplicaStatus:
    """Describe this rank's copy of a DTensor laid out as ``placements`` on ``mesh``.

    Raises :class:`~shardscale.core.LayoutError` for ``Partial`` placements:
    their local tensors are unreduced summands, whose norms and overflow
    status say nothing exact about the gradient.
    """
    for dim, placement in enumerate(placements):
        if placement.is_partial():
            raise LayoutError(
                f"a DTensor gradient has the pending-reduction placement {placement!r} on mesh "
                f"dim {dim} ({_dim_label(mesh, dim)}); its local values are partial sums, so "
                "neither its norm nor its overflow status can be read from them. Reduce it first "
                "(grad.redistribute(placements=[Replicate() or Shard(d), ...])) or give the "
                "parameter a layout whose gradient is Shard/Replicate."
            )
    # The mesh arithmetic below is pure Python over rank tables: do it once per layout.
    return _cached_status(mesh, tuple(placements), distinct_dims, global_rank)


def _dim_label(mesh: DeviceMesh, dim: int) -> str:
    names = mesh.mesh_dim_names
    return repr(names[dim]) if names is not None and dim < len(names) else "unnamed"


@functools.lru_cache(maxsize=512)
def _cached_status(
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    distinct_dims: frozenset[str],
    global_rank: int,
) -> ReplicaStatus:
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        # This rank is outside the mesh: its local tensor is empty and contributes nothing.
        return ReplicaStatus(counts=False, ranks=None)
    names = mesh.mesh_dim_names or ()
    counts = True
    for dim, placement in enumerate(placements):
        named_distinct = dim < len(names) and names[dim] in distinct_dims
        if placement.is_replicate() and coordinate[dim] != 0 and not named_distinct:
            counts = False
    own = mesh.mesh.flatten().tolist()
    if counts:
        counts = _is_canonical_translate(mesh, frozenset(own), distinct_dims)
    return ReplicaStatus(counts=counts, ranks=frozenset(int(r) for r in own))


def _is_canonical_translate(
    mesh: DeviceMesh, own: frozenset[int], distinct_dims: frozenset[str]
) -> bool:
    """Whether ``own`` (this rank's slice of the root mesh) is the counting replica."""
    root = mesh._get_root_mesh()
    if root is mesh:
        return True
    return counting_translate(own, root.mesh, root.mesh_dim_names or (), distinct_dims)


def counting_translate(
    own: frozenset[int],
    root_table: torch.Tensor,
    root_names: Sequence[str],
    distinct_dims: frozenset[str],
) -> bool:
    """Whether the slice translate ``own`` counts among its replicas in ``root_table``.

    ``root_table`` is the root mesh as a tensor of global ranks, with dims
    named ``root_names``. See [Note: replicas of a DTensor shard].
    """
    if int(root_table.numel()) == len(own) or ALL_DIMS in distinct_dims:
        return True
    distinct_axes = [i for i, name in enumerate(root_names) if name in distinct_dims]
    signature_of: dict[int, tuple[int, ...]] = {}
    for index in torch.nonzero(torch.ones_like(root_table, dtype=torch.bool)).tolist():
        rank = int(root_table[tuple(index)])
        signature_of[rank] = tuple(index[i] for i in distinct_axes)
    outside = own - signature_of.keys()
    if outside:
        raise LayoutError(
            f"a DTensor mesh holds ranks {sorted(outside)} that its root mesh does not "
            f"({root_table.tolist()}); shardscale cannot tell which ranks hold replicas."
        )
    signatures = {signature_of[r] for r in own}
    # Ranks of every translate that is a replica of ours; the one with the smallest rank counts.
    replicas = [r for r, sig in signature_of.items() if sig in signatures]
    return min(replicas) in own
