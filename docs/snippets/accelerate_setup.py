"""Stand-ins for the names the Accelerate pages leave to the reader: a Hugging Face-style model
(its output has a ``.loss``), an optimizer, a scheduler and a loader of dict batches."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

__all__ = ["loader", "model", "optimizer", "scheduler"]


class _TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(loss=nn.functional.mse_loss(self.linear(x).float(), labels))


torch.manual_seed(0)
model = _TinyModel()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
loader = torch.utils.data.DataLoader(
    [{"x": torch.randn(16), "labels": torch.randn(4)} for _ in range(12)], batch_size=4
)
