"""The adapter for FSDP1 (``FullyShardedDataParallel``) parameters, flat or original.

[Note: finding an FSDP1 parameter's groups]
FSDP1 keeps a parameter's sharding strategy and process groups on the
``FullyShardedDataParallel`` module (its ``_FSDPState``) and the
``FlatParamHandle``; neither the ``FlatParameter`` nor, with
``use_orig_params=True``, the original parameters point back to them (the only
mark FSDP1 leaves on them is ``_fsdp_flattened``). So the layout of each
parameter is recorded in a weak, identity-keyed table:

* :func:`register_fsdp1` fills it explicitly from a wrapped model; cheap and
  predictable, call it once after wrapping;
* otherwise, the first time the adapter meets an FSDP1 parameter it does not
  know, it looks for live ``FullyShardedDataParallel`` modules among the
  garbage collector's tracked objects and registers all of them (one scan per
  newly wrapped model, nothing per step). That keeps the scaler zero-config.

FSDP1 shards one flat parameter per wrapped module; what a rank holds is:

=================================  ============================  ===========================
strategy                           this rank's local gradient    counts towards sums
=================================  ============================  ===========================
FULL_SHARD, SHARD_GRAD_OP          a distinct shard (maybe 0     always
                                   elements, maybe padded with
                                   zeros)
HYBRID_SHARD, _HYBRID_SHARD_ZERO2  a shard, replicated over the  on rank 0 of the
                                   inter-node (replicate) group  replicate group
NO_SHARD                           the whole gradient,           on rank 0 of the group
                                   replicated over the group
=================================  ============================  ===========================
"""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shardscale.core import AdapterContext, GradShard, LayoutError
from shardscale.core.plugins import is_fsdp1_param

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["FSDP1_PRIORITY", "Fsdp1Adapter", "Fsdp1Layout", "fsdp1_layout", "register_fsdp1"]

#: Above DTensor (20) and plain tensors (0): FlatParameters look like plain Parameters.
FSDP1_PRIORITY = 30

_REPLICATED = frozenset({"NO_SHARD"})
_HYBRID = frozenset({"HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"})


@dataclass(frozen=True, slots=True)
class Fsdp1Layout:
    """How FSDP1 lays out one parameter's gradient on this rank."""

    #: The ``HandleShardingStrategy`` name, e.g. ``"FULL_SHARD"``.
    strategy: str
    #: Whether this rank's copy counts towards global sums.
    counts: bool
    #: Global ranks of the shard group and (hybrid) the replicate group together.
    ranks: frozenset[int]


_layouts: WeakIdKeyDictionary = WeakIdKeyDictionary()
_lock = threading.Lock()


def _group_ranks(group: ProcessGroup) -> list[int]:
    import torch.distributed as dist

    return [int(r) for r in dist.get_process_group_ranks(group)]


def _layout_of_state(state: Any) -> tuple[Any, Fsdp1Layout] | None:
    """The flat parameter of one ``FullyShardedDataParallel`` module and its layout."""
    import torch.distributed as dist

    handle = getattr(state, "_handle", None)
    if handle is None:  # a wrapper that owns no parameters
        return None
    strategy = str(handle._sharding_strategy.name)
    shard_group = state.process_group
    ranks = set(_group_ranks(shard_group))
    if strategy in _HYBRID:
        replicate_group = state._inter_node_pg
        ranks.update(_group_ranks(replicate_group))
        counts = dist.get_rank(replicate_group) == 0
    elif strategy in _REPLICATED:
        counts = dist.get_rank(shard_group) == 0
    else:
        counts = True
    return handle.flat_param, Fsdp1Layout(strategy, counts, frozenset(ranks))


def register_fsdp1(model: torch.nn.Module) -> int:
    """Record the sharding of every FSDP1-managed parameter of ``model``.

    Optional: the adapter finds wrapped models by itself the first time it
    meets one of their parameters (see [Note: finding an FSDP1 parameter's
    groups]); calling this once after wrapping skips that search. Covers the
    ``FlatParameter`` s (``use_orig_params=False``) and the original parameters
    (``use_orig_params=True``) of every nested ``FullyShardedDataParallel``.
    Returns how many parameters were recorded.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"register_fsdp1() takes the FSDP1-wrapped model (an nn.Module), got "
            f"{type(model).__name__}"
        )
    states = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    if not states:
        raise LayoutError(
            f"register_fsdp1() found no FullyShardedDataParallel module in {type(model).__name__}; "
            "call it on the model returned by FullyShardedDataParallel(...), after wrapping."
        )
    return _register_states(states)


def _register_states(states: list[Any], *, skip_broken: bool = False) -> int:
    recorded = 0
    with _lock:
        for state in states:
            try:
                found = _layout_of_state(state)
            except Exception:
                # A dead wrapper found by the search (its process group destroyed) is no
                # owner of live parameters; an explicit register_fsdp1() call reports it.
                if not skip_broken:
                    raise
                continue
            if found is None:
                continue
            flat_param, layout = found
            _layouts[flat_param] = layout
            recorded += 1
            for param in (*(flat_param._params or ()), *(flat_param._shared_params or ())):
                _layouts[param] = layout
                recorded += 1
    return recorded


def _discover() -> None:
    """Register every live FSDP1 module (see [Note: finding an FSDP1 parameter's groups])."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    # type() rather than isinstance(): some tracked objects warn when asked for __class__.
    states = [o for o in gc.get_objects() if issubclass(type(o), FullyShardedDataParallel)]
    _register_states(states, skip_broken=True)


def fsdp1_layout(param: torch.Tensor) -> Fsdp1Layout | None:
    """The recorded FSDP1 layout of ``param`` (searching live FSDP1 modules once if needed)."""
    layout = _recorded(param)
    if layout is None and is_fsdp1_param(param):
        _discover()
        layout = _recorded(param)
    return layout


def _recorded(param: torch.Tensor) -> Fsdp1Layout | None:
    if param not in _layouts:
        return None
    layout: Fsdp1Layout = _layouts[param]
    return layout


class Fsdp1Adapter:
    """Describes gradients of parameters managed by FSDP1 ``FullyShardedDataParallel``.

    Claims ``FlatParameter`` s and, with ``use_orig_params=True``, the original
    parameters (both carry FSDP1's ``_fsdp_flattened`` mark), but not DTensors.
    ``local`` is the gradient as FSDP1 leaves it (a shard, possibly empty or
    zero-padded); ``counts`` and ``ranks`` follow the strategy of the wrapper
    that owns the parameter (see [Note: finding an FSDP1 parameter's groups]).
    """

    name: ClassVar[str] = "fsdp1"
    priority: ClassVar[int] = FSDP1_PRIORITY
    #: Its answer depends only on the gradient's layout and the step's context (the step plan).
    stable_layout: ClassVar[bool] = True

    def claims(self, param: torch.Tensor) -> bool:
        """Plain-tensor parameters that FSDP1 flattened or registered."""
        if type(param) not in (torch.Tensor, torch.nn.Parameter):
            return False  # DTensor parameters (FSDP1 + TP) are the DTensor adapter's
        return param in _layouts or is_fsdp1_param(param)

    def claims_type(self, kind: type) -> bool | None:
        """None of a tensor subclass (DTensor); a plain parameter's FSDP1 marks decide."""
        return None if kind in (torch.Tensor, torch.nn.Parameter) else False

    def describe(self, param: torch.Tensor, grad: torch.Tensor, ctx: AdapterContext) -> GradShard:
        """The local gradient and whether this rank's copy counts."""
        del ctx  # FSDP1's own groups decide, not the caller's
        layout = fsdp1_layout(param)
        if layout is None:
            raise LayoutError(
                f"a parameter of shape {tuple(param.shape)} is marked as FSDP1-managed but no "
                "live FullyShardedDataParallel module owns it; call "
                "shardscale.fsdp.register_fsdp1(model) with the wrapped model, or take the "
                "parameter out of the optimizer."
            )
        return GradShard(local=grad, counts=layout.counts, ranks=layout.ranks)
