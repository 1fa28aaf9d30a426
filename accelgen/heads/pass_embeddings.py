"""PaSS look-ahead embeddings (Monea et al. 2023, arXiv:2311.13581): k trained vectors with which the target
drafts for itself.

They are fed after the last committed token in place of token embeddings. The target's logits at look-ahead
slot i then guess the token i + 2 places after the committed text (the last token's own row guesses the next
one, as always). `accelgen train pass` trains them (train/pass_embeddings.py); `pass` drafts with them
(drafters/pass_embeddings.py).
"""

from __future__ import annotations

import torch

from accelgen.errors import InputError
from accelgen.heads.io import load_heads, save_heads

NAME = "pass_embeddings"


class LookaheadEmbeddings(torch.nn.Module):
    def __init__(self, count: int, hidden_size: int, vocab_size: int = 0, base_model: str = "", layer_count: int = 0):
        super().__init__()
        if count < 1:
            raise InputError(f"PaSS needs at least one look-ahead embedding, got {count}")
        self.hidden_size, self.vocab_size, self.base_model, self.layer_count = hidden_size, vocab_size, base_model, layer_count
        self.vectors = torch.nn.Parameter(torch.zeros(count, hidden_size))  # (k, d)

    def __len__(self) -> int:
        return len(self.vectors)

    def describe_shape(self) -> dict:
        return {"hidden_size": self.hidden_size, "layer_count": self.layer_count, "vocab_size": self.vocab_size}

    def save(self, folder) -> None:
        save_heads(self, folder, NAME, {"count": len(self), "base_model": self.base_model, **self.describe_shape()})

    @classmethod
    def load(cls, folder, model=None) -> "LookaheadEmbeddings":
        return load_heads(cls, folder, NAME, "accelgen train pass", model)
