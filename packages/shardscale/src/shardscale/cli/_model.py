"""A small decoder-only transformer (GPT-style) for the demo.

Attention projections are separate ``q``/``k``/``v`` linears on purpose: under
tensor parallelism each is split by output features, so every rank holds whole
heads and the attention code needs no knowledge of the split (it infers the
local head count from the tensor shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "TinyGPT", "Block"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Shape of :class:`TinyGPT`. The defaults give about 3.2 million parameters."""

    vocab_size: int
    context: int = 128
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )


class Attention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, d_model)`` -> ``(B, T, d_model)``."""
        b, t, _ = x.shape

        # -1 heads: under tensor parallelism q/k/v hold only this rank's heads.
        def heads(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, -1, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))  # type: ignore[no-any-return]


class MLP(nn.Module):
    """Position-wise feed-forward layer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, d_model)`` -> ``(B, T, d_model)``."""
        return self.proj(F.gelu(self.fc(x)))  # type: ignore[no-any-return]


class Block(nn.Module):
    """Pre-norm transformer block: the unit FSDP shards and TP splits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual attention then residual MLP."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class TinyGPT(nn.Module):
    """Character-level language model: embeddings, blocks, final norm, output head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2 style: small normal weights keep the first losses near ln(vocab).
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` -> logits ``(B, T, vocab_size)``."""
        t = idx.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds the model context {self.cfg.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]

    def num_parameters(self) -> int:
        """Number of (logical, unsharded) parameters."""
        return sum(p.numel() for p in self.parameters())
