"""The adapter for plain tensors: grads identical on every rank (DDP, single process)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import ClassVar

import torch

from shardscale.core._protocols import AdapterContext, GradShard

__all__ = ["PlainTensorAdapter", "is_fsdp1_param"]


def is_fsdp1_param(param: torch.Tensor) -> bool:
    """Whether FSDP1 manages ``param`` (a ``FlatParameter``, or an original parameter of one)."""
    return bool(getattr(param, "_fsdp_flattened", False)) or type(param).__name__ == "FlatParameter"


class PlainTensorAdapter:
    """Describes ordinary ``torch.Tensor`` gradients.

    A plain gradient is taken to be replicated over the reduction group (that
    is what DDP and a single process give), so only group rank 0 counts it
    towards sums. Parameters of pipeline stages held in plain tensors are
    different on each rank: declare that with ``distinct_dims={"*"}`` (every
    rank holds its own) on the scaler or the clip call. When only some plain
    parameters differ per rank (experts placed on this rank beside replicated
    dense layers), name those in ``distinct_params``.
    """

    name: ClassVar[str] = "plain"
    priority: ClassVar[int] = 0
    #: Its answer depends only on the gradient's class and the step's context (the step plan).
    stable_layout: ClassVar[bool] = True

    def claims(self, param: torch.Tensor) -> bool:
        """Plain tensors (exact ``torch.Tensor`` or ``nn.Parameter``), not subclasses like DTensor.

        FSDP1's parameters look plain but each rank holds a different shard:
        claiming them would count one shard as the whole gradient, so they are
        left to the FSDP1 adapter (``pip install shardscale-fsdp``).
        """
        if is_fsdp1_param(param):
            return False
        # issubclass, not isinstance: a DTensor parameter passes isinstance(Parameter) and its
        # .data is a DTensor dispatch per call (the hot part of a step with many parameters).
        return type(param) in (torch.Tensor, torch.nn.Parameter) or (
            issubclass(type(param), torch.nn.Parameter) and type(param.data) is torch.Tensor
        )

    def claims_type(self, kind: type) -> bool | None:
        """False for classes it never claims; None where the parameter itself decides."""
        if kind in (torch.Tensor, torch.nn.Parameter) or issubclass(kind, torch.nn.Parameter):
            return None  # FSDP1's marks, or a Parameter subclass's .data, decide
        return False

    def layout_keys(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], ctx: AdapterContext
    ) -> list[Hashable]:
        """Per parameter, what :meth:`describe`'s answer rests on: whether it is declared distinct."""
        del grads
        if ctx.rank == 0 or "*" in ctx.distinct_dims or not ctx.distinct_params:
            return [True] * len(params)  # every parameter counts alike
        return list(map(ctx.distinct_params.__contains__, map(id, params)))

    def describe(self, param: torch.Tensor, grad: torch.Tensor, ctx: AdapterContext) -> GradShard:
        """The grad itself; counted on group rank 0 unless declared distinct on every rank."""
        counts = ctx.rank == 0 or "*" in ctx.distinct_dims or id(param) in ctx.distinct_params
        return GradShard(local=grad, counts=counts, ranks=None)
