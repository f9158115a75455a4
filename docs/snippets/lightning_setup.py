"""Stand-ins for the names the Lightning pages leave to the reader: a ``LightningModule`` and a
``LightningDataModule``. The module ends the run after 3 steps so that the docs test is short
(the Trainer's defaults would train for 1000 epochs)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

__all__ = ["datamodule", "model"]


class _TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_step >= 2:
            self.trainer.should_stop = True
        return nn.functional.mse_loss(self.linear(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _TinyData(pl.LightningDataModule):
    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        data = torch.utils.data.TensorDataset(torch.randn(32, 16), torch.randn(32, 4))
        return torch.utils.data.DataLoader(data, batch_size=8)


torch.manual_seed(0)
model = _TinyModule()
datamodule = _TinyData()
