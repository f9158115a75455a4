"""The scaler's ``kernels`` option reaches every clip path of the Lightning and Accelerate integrations.

One process. A stats-kernels plugin registered in-process (in a private
registry handed to the scaler) records which of its kernels run. It ranks
below the built-in ones, so it computes a norm only when the scaler's
``kernels=`` names it: an integration that clipped without the scaler's
configuration would compute the norm with the built-in kernels and leave the
record without a norm read. The scaler's own unscale runs ``unscale_and_check_``
(no norm), so "norms" in the record is the clip.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import pytest
import torch

from shardscale.core import ForeachKernels, Registry, ShardedGradScaler, hookimpl

pl = pytest.importorskip("lightning.pytorch")
pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from shardscale.accelerate import use_shardscale  # noqa: E402
from shardscale.lightning import ShardscalePrecision  # noqa: E402


class _RecordingKernels(ForeachKernels):
    name: ClassVar[str] = "recording"
    priority: ClassVar[int] = -100  # never the automatic choice

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def unscale_and_check_(
        self, tensors: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
    ) -> None:
        self.calls.append("unscale")
        super().unscale_and_check_(tensors, found_inf, inv_scale)

    def tensor_norms(self, tensors: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        self.calls.append("norms")
        return super().tensor_norms(tensors, norm_type)

    def mul_(self, tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
        self.calls.append("mul")
        super().mul_(tensors, coef)


class _Plugin:
    def __init__(self, calls: list[str]) -> None:
        self.kernels = _RecordingKernels(calls)

    @hookimpl
    def shardscale_stats_kernels(self) -> list[Any]:
        return [self.kernels]


@pytest.fixture
def recorded() -> Iterator[tuple[Registry, list[str]]]:
    calls: list[str] = []
    registry = Registry()
    registry.register(_Plugin(calls), name="recording-kernels")
    yield registry, calls


def _scaler(registry: Registry, kernels: str | None) -> ShardedGradScaler:
    return ShardedGradScaler("cpu", init_scale=256.0, kernels=kernels, registry=registry)


# -- Lightning --------------------------------------------------------------------------------


class _Net(pl.LightningModule):
    """``how``: the Trainer's clip (fused with the unscale), the module's own clip hook after
    the unscale (the scaler's clip), or a manual ``self.clip_gradients`` (fused)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 2)
        self.how = how
        self.automatic_optimization = how != "manual"

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        loss = self.lin(batch[0]).square().mean()
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.01, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()
        return None

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        if self.how == "hook":
            self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="norm")
        else:
            super().configure_gradient_clipping(
                optimizer, gradient_clip_val, gradient_clip_algorithm
            )

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("how", ["trainer", "hook", "manual"])
@pytest.mark.parametrize("kernels", ["recording", None])
def test_lightning_clips_with_the_scalers_kernels(
    recorded: tuple[Registry, list[str]], how: str, kernels: str | None
) -> None:
    registry, calls = recorded
    plugin = ShardscalePrecision("16-mixed", device="cpu", scaler=_scaler(registry, kernels))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], max_steps=2, logger=False,
        gradient_clip_val=0.01 if how == "trainer" else None,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    trainer.fit(_Net(how), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), 4))
    assert plugin.grad_norm is not None  # it clipped
    if kernels is None:
        assert calls == []  # the built-in kernels: the recorder is never chosen by itself
    else:
        # Each of the 2 steps: the norm and the clip's multiply in the scaler's kernels.
        assert calls.count("norms") >= 2 and calls.count("mul") >= 2


# -- Accelerate -------------------------------------------------------------------------------


@pytest.fixture
def fresh_accelerate() -> Iterator[None]:
    # Accelerate keeps process-wide singletons: start and end without them.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.mark.usefixtures("fresh_accelerate")
@pytest.mark.parametrize("subset", [False, True], ids=["all-params", "subset"])
@pytest.mark.parametrize("kernels", ["recording", None])
def test_accelerate_clips_with_the_scalers_kernels(
    recorded: tuple[Registry, list[str]], subset: bool, kernels: str | None
) -> None:
    registry, calls = recorded
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    use_shardscale(acc, scaler=_scaler(registry, kernels))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    acc.backward(model(x).square().mean())
    # A subset goes through unscale_gradients + the scaler's clip; all of one optimizer's
    # parameters through the clip fused with the unscale.
    params = list(model[-1].parameters()) if subset else list(model.parameters())
    norm = acc.clip_grad_norm_(params, 0.01)
    opt.step()
    assert torch.isfinite(norm)
    if kernels is None:
        assert calls == []
    else:
        assert calls.count("norms") >= 1 and calls.count("mul") >= 1
