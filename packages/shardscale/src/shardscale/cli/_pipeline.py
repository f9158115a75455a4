"""The demo's pipeline: TinyGPT cut into stages, run by ``torch.distributed.pipelining``.

[Note: fp16 with pipeline stages]
With ``--mesh ppN[,dpM]`` each rank holds one stage (a run of consecutive
blocks; the first stage also the embeddings, the last the final norm and the
head), FSDP2-sharded over the ``dp`` ranks of its stage. ``Schedule1F1B``
runs ``N`` microbatches per step. Only the last stage computes the loss, so
only it calls ``scaler.scale``; the other stages' scalers never scale
anything and create their scale from ``init_scale`` at their first step. The
scaler is built with ``layout=Layout(distinct_dims=("pp",))``, so
``unscale_and_clip_`` clips every stage by the norm of the whole model, in the
one collective over every rank, and every stage skips on the same steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from shardscale.cli._distributed import DistContext
    from shardscale.cli._model import TinyGPT
    from shardscale.core import ShardedGradScaler

__all__ = ["Pipeline", "Stage", "stage_blocks"]


def stage_blocks(n_layers: int, stages: int, stage: int) -> range:
    """The block indices stage ``stage`` of ``stages`` holds (earlier stages take the extras)."""
    base, extra = divmod(n_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


class Stage(nn.Module):
    """One pipeline stage of a :class:`TinyGPT`, its parameters named as in the whole model."""

    def __init__(self, model: TinyGPT, stage: int, stages: int) -> None:
        super().__init__()
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.tok, self.pos = model.tok, model.pos
        # A ModuleDict keyed by the block's index keeps the state-dict names of the whole model.
        self.blocks = nn.ModuleDict(
            {str(i): model.blocks[i] for i in stage_blocks(len(model.blocks), stages, stage)}
        )
        if self.last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states or logits (last) out."""
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


class Pipeline:
    """This rank's stage, FSDP2-sharded over its ``dp`` ranks, and the schedule that runs it."""

    def __init__(self, model: TinyGPT, ctx: DistContext, *, batch_size: int) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self.ctx = ctx
        stages = ctx.shape.pp
        self.module = Stage(model, ctx.pp_rank, stages)
        dp_mesh = ctx.mesh["dp"]
        for block in self.module.blocks.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(self.module, mesh=dp_mesh)
        self.pp_group = ctx.mesh["pp"].get_group()
        stage = PipelineStage(self.module, ctx.pp_rank, stages, ctx.device, group=self.pp_group)
        self._scaler: ShardedGradScaler | None = None
        self._losses: list[torch.Tensor] = []
        # One microbatch per stage: the fewest 1F1B accepts (the batch is checked to divide).
        self.schedule = Schedule1F1B(stage, n_microbatches=stages, loss_fn=self._loss_fn)
        del batch_size  # kept in the signature: the checks in _options use the same rule

    def _loss_fn(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        self._losses.append(loss.detach())
        assert self._scaler is not None
        return self._scaler.scale(loss)  # the last stage scales the loss it computes

    def step(
        self, x: torch.Tensor, y: torch.Tensor, scaler: ShardedGradScaler, dtype: torch.dtype
    ) -> torch.Tensor:
        """Forward and backward of one batch through every stage; the batch's mean loss.

        The returned loss is the same on every stage of this pipeline (the last
        stage's, shared over the ``pp`` group for reporting).
        """
        self._scaler, self._losses = scaler, []
        with torch.autocast(x.device.type, dtype=dtype):
            if self.module.first:
                self.schedule.step(x)
            elif self.module.last:
                self.schedule.step(target=y)
            else:
                self.schedule.step()
        # The schedule's first step also runs the loss once on a shape-inference pass (values
        # not real): the batch's losses are the last n_microbatches calls.
        real = self._losses[-self.schedule._n_microbatches :]
        loss = torch.stack(real).mean() if real else torch.zeros((), device=x.device)
        dist.all_reduce(loss, group=self.pp_group)  # only the last stage holds a nonzero loss
        return loss

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of the whole model, gathered on every rank (a collective)."""
        mine: dict[str, Any] = {}
        for name, value in self.module.state_dict().items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            mine[name] = full.detach().cpu().contiguous()
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            out.update(part)
        return out
