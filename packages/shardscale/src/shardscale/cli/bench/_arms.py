"""The arms: one model copy each, post-processed with torch's recipe or with shardscale's.

``torch`` and ``torch_aa`` run the same recipe on identical copies: their
ratio is the noise floor (A/A). ``ours`` is ``unscale_and_clip_`` + ``step`` +
``update`` with the default options (the optimizer stepped as built);
``ours_fuse_optimizer`` is ``ours`` with ``fuse_optimizer=True`` (an unfused
optimizer's step run through torch's fused kernel: the sync-free path);
``ours_streaming`` adds :class:`~shardscale.clip.StreamingStats`,
whose hooks run inside backward and are timed there; ``ours_foreach`` (CUDA
only) is ``ours`` with the ``foreach`` kernels, beside ``ours`` with the
kernels the device picks (shardscale-triton's where installed).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardscale.cli.bench._workload import Net, make_optimizer, shard

__all__ = ["Arm", "counting_spec", "make_arms", "make_scaler"]


def counting_spec(spec: str) -> str:
    """``spec`` with the ``counting`` middleware in front (collectives are counted with it)."""
    return spec if "counting" in spec.split("+") else f"counting+{spec}"


def make_scaler(recipe: str, device: str, backend: str) -> Any:
    """torch's GradScaler or ours, both starting at 2**10 and never growing during a run."""
    if recipe.startswith("ours"):
        from shardscale.core import ShardedGradScaler

        return ShardedGradScaler(
            device,
            backend=counting_spec(backend),
            init_scale=2.0**10,
            growth_interval=10_000,
            fuse_optimizer=recipe == "ours_fuse_optimizer",
        )
    return torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=10_000)


@dataclass(slots=True)
class Arm:
    """One recipe on its own copy of the model."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    scaler: Any
    stream: Any = None

    @property
    def ours(self) -> bool:
        """Whether this arm uses shardscale's recipe."""
        return self.name.startswith("ours")

    def post(self, max_norm: float) -> None:
        """Everything after backward: unscale, clip, step, update."""
        self.clip(max_norm)
        self.scaler.step(self.opt)
        self.scaler.update()

    def clip(self, max_norm: float) -> None:
        """Unscale and clip (no step): ours in one call, torch's in two."""
        if self.ours:
            from shardscale.clip import unscale_and_clip_

            # ours_foreach: the foreach kernels beside whatever the device picks (Triton on CUDA).
            foreach = True if self.name == "ours_foreach" else None
            unscale_and_clip_(self.scaler, self.opt, max_norm, 2.0, foreach, stats=self.stream)
        else:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def restream(self) -> None:
        """Replace the streaming hooks by fresh ones (registered after any hooks added since)."""
        from shardscale.clip import StreamingStats

        if self.stream is not None:
            self.stream.remove()
            self.stream = StreamingStats(self.model.parameters(), self.scaler)


def make_arms(
    names: tuple[str, ...], base: Net, shape: tuple[int, ...], opt_name: str, *, device: str,
    backend: str,
) -> tuple[list[Arm], int]:  # fmt: skip
    """Shard a copy of ``base`` per arm; returns the arms and this rank's dp index."""
    from shardscale.clip import StreamingStats

    arms: list[Arm] = []
    dp_rank = 0
    for name in names:
        model, dp_rank = shard(copy.deepcopy(base), shape, device)
        opt = make_optimizer(opt_name, model.parameters())
        scaler = make_scaler(name, device, backend)
        stream = StreamingStats(model.parameters(), scaler) if name == "ours_streaming" else None
        arms.append(Arm(name, model, opt, scaler, stream))
    return arms, dp_rank
