"""``clip_grad_norm_`` with torchtitan's signature and shardscale's one collective.

[Note: torchtitan's layout arguments, mapped]
torchtitan (``torchtitan.distributed.utils.clip_grad_norm_``) measures the norm
with ``torch.nn.utils.get_total_norm``, makes each partial DTensor norm a plain
tensor (one all-reduce per mesh group: once for the dense parameters, once
more for the experts when ``ep_enabled``), then all-reduces across pipeline
stages over ``pp_mesh``: 1 to 4 collectives, and a second pass to clip.
shardscale's engine reads every DTensor's mesh and placements itself, so:

* ``ep_enabled`` needs nothing: expert and dense parameters on different
  meshes are combined in the same all-reduce (torchtitan's older
  ``ep_dense_params_mesh_ndim`` is accepted and unused for the same reason);
* ``pp_mesh`` says that its dim holds *different* parameters on each
  coordinate: with DTensor parameters it becomes ``distinct_dims=(its dim
  name,)`` over the default group (the meshes must be slices of a root mesh
  that has that dim, as torchtitan's are); with plain-tensor stages (pipeline
  only, one stage per rank) the sum runs over ``pp_mesh``'s group with every
  rank's parameters counted, exactly torchtitan's reduction.

[Note: one layout on every rank]
The two reductions run over different process groups (the default group, or
``pp_mesh``'s), so every rank must pick the same one, or the ranks wait in
different collectives (a hang on pp 2 x dp 2) or disagree on the declaration
(a ``DeclarationError`` where both groups are the whole world). The choice is
made from the *parameters*, which every stage has whether or not they got a
gradient: a frozen stage (``requires_grad=False``, or a stage whose backward
produced no gradient) holds DTensor parameters exactly like its peers, so it
joins the same all-reduce with nothing to add, as torchtitan's own function
adds a norm of 0 there. A rank given no parameters at all has nothing to
decide from; it takes the plain path when ``pp_mesh`` spans the whole world
(pipeline only: nothing else to shard over) and the DTensor path otherwise
(torchtitan shards the other dims with FSDP/TP). Whether the gradients present
are DTensors or plain is checked afterwards, against the path chosen.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from shardscale.clip import clip_grad_norm_ as _clip_grad_norm_
from shardscale.core import CollectiveBackend

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["clip_grad_norm_"]


def _pipeline_layout(
    params: list[torch.Tensor], pp_mesh: DeviceMesh | None
) -> tuple[tuple[str, ...], ProcessGroup | None]:
    """``(distinct_dims, process_group)`` for the engine (see the note)."""
    if pp_mesh is None:
        return (), None
    from torch.distributed.tensor import DTensor

    names = pp_mesh.mesh_dim_names
    if pp_mesh.ndim != 1 or not names:
        raise ValueError(
            f"pp_mesh must be a 1-D DeviceMesh with a dim name (torchtitan's "
            f"parallel_dims.get_optional_mesh('pp')), got a {pp_mesh.ndim}-D mesh with dim "
            f"names {names}"
        )
    if params:
        # From the parameters, never the gradients: see [Note: one layout on every rank].
        dtensor_path = any(isinstance(p, DTensor) for p in params)
    else:
        import torch.distributed as dist

        dtensor_path = pp_mesh.size() != dist.get_world_size()
    grads = [p.grad for p in params if p.grad is not None]
    dtensors = sum(isinstance(g, DTensor) for g in grads)
    if not dtensor_path:
        return ("*",), pp_mesh.get_group()
    if dtensors != len(grads):
        raise ValueError(
            f"with pp_mesh, the gradients must be all DTensors or all plain tensors; got "
            f"{dtensors} DTensor and {len(grads) - dtensors} plain gradients. Make the plain "
            "parameters DTensors (fully_shard / replicate on the stage's mesh), or call "
            "shardscale.clip.clip_grad_norm_ with distinct_dims/distinct_params that say which "
            "plain parameters differ per rank."
        )
    return (names[0],), None


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
    ep_enabled: bool = False,
    ep_dense_params_mesh_ndim: int | None = None,
    *,
    backend: str | CollectiveBackend | None = None,
) -> torch.Tensor:
    """A drop-in for torchtitan's ``clip_grad_norm_``: the same norm, ONE collective.

    Takes the arguments of ``torchtitan.distributed.utils.clip_grad_norm_``
    and returns what it returns: the total norm of the gradients of every
    parameter on every rank (FSDP/TP shards, expert shards and pipeline stages
    each counted once), as a plain 0-dim tensor, identical on every rank,
    after clipping them in place by ``min(1, max_norm / (norm + 1e-6))``.
    One read of every local gradient, one all-reduce, one multiply.

    Args:
        parameters: the parameters (or one tensor) whose gradients are clipped.
        max_norm: the largest norm allowed (``inf``: measure only).
        norm_type: the p of the p-norm (``inf`` for the max norm).
        error_if_nonfinite: raise, on every rank and before any gradient
            changes, when the norm is inf or nan.
        foreach: ``False`` picks the per-tensor kernels; else the default.
        pp_mesh: the pipeline-parallel mesh (its dim holds different stages).
        ep_enabled: accepted for torchtitan's signature; experts need no flag.
        ep_dense_params_mesh_ndim: accepted for older torchtitan releases; unused.
        backend: shardscale's collective backend spec (default: automatic).

    Raises:
        ValueError: ``pp_mesh`` is not a named 1-D mesh, or mixes DTensor and
            plain gradients (see the message for the fix).
    """
    del ep_enabled, ep_dense_params_mesh_ndim  # the engine reads each DTensor's mesh instead
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    distinct_dims, group = _pipeline_layout(params, pp_mesh)
    return _clip_grad_norm_(
        params,
        max_norm,
        norm_type,
        error_if_nonfinite,
        foreach,
        process_group=group,
        backend=backend,
        distinct_dims=distinct_dims,
    )
