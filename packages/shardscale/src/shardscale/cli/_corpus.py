"""The demo's training text, shipped inside the package, and a character-level tokenizer.

The text is Shakespeare's *Sonnets* (1609), public domain everywhere; see
``data/SOURCE.md`` for where this copy comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import torch

__all__ = ["CORPUS_NAME", "CharCorpus", "load_corpus"]

CORPUS_NAME = "sonnets.txt"


@dataclass(frozen=True, slots=True)
class CharCorpus:
    """A text encoded one character per token, split into a training and a held-out part."""

    vocab: str
    train: torch.Tensor
    held_out: torch.Tensor

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.vocab)

    def decode(self, ids: torch.Tensor) -> str:
        """Characters for a 1-D tensor of token ids."""
        return "".join(self.vocab[int(i)] for i in ids.tolist())

    def batch(
        self, generator: torch.Generator, *, batch_size: int, context: int, held_out: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows ``(inputs, targets)`` of shape ``(batch_size, context)``, int64.

        Targets are the inputs shifted by one character (next-character prediction).
        """
        data = self.held_out if held_out else self.train
        if data.numel() <= context + 1:
            raise ValueError(
                f"context={context} is longer than the {'held-out' if held_out else 'training'} "
                f"text ({data.numel()} characters); pass a smaller --context"
            )
        starts = torch.randint(0, data.numel() - context - 1, (batch_size,), generator=generator)
        offsets = torch.arange(context + 1)
        windows = data[starts[:, None] + offsets[None, :]]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def load_corpus(*, held_out_fraction: float = 0.1) -> CharCorpus:
    """Read the shipped text and encode it; the last ``held_out_fraction`` is kept for evaluation."""
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction!r}")
    text = (
        resources.files("shardscale.cli").joinpath("data").joinpath(CORPUS_NAME).read_text("utf-8")
    )
    vocab = "".join(sorted(set(text)))
    index = {ch: i for i, ch in enumerate(vocab)}
    ids = torch.tensor([index[ch] for ch in text], dtype=torch.int64)
    split = int(ids.numel() * (1.0 - held_out_fraction))
    return CharCorpus(vocab=vocab, train=ids[:split], held_out=ids[split:])
