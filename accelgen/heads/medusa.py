"""Medusa heads (Cai et al. 2024, arXiv:2401.10774): K residual blocks over the target's last hidden state,
each guessing a token further on.

Head k (k = 1..K) reads the target's feature at position t (its last hidden state, after the final norm) and
predicts the token at t + k + 1. The target's own LM head already predicts t + 1. A head is one residual block,
h + silu(W·h), with W starting at zero, followed by the target's LM head. Medusa-1 gives each head its own
copy of the LM head; here the copy is *shared and frozen*. On Qwen2.5-1.5B a copy would be 152k × 1536
weights (about 0.9 GB in float32) per head, and training it on a CPU would cost as much again. Blockwise
parallel decoding (Stern et al. 2018) uses the same kind of heads, so `blockwise` and `medusa` share them
(drafters/medusa.py); `accelgen train medusa` trains them (train/medusa.py).
"""

from __future__ import annotations

import torch

from accelgen.errors import InputError
from accelgen.heads.io import load_heads, save_heads
from accelgen.heads.lm_head import DraftLMHead

NAME = "medusa_heads"


class MedusaHeads(torch.nn.Module):
    def __init__(self, heads: int, hidden_size: int, vocab_size: int = 0, base_model: str = "", layer_count: int = 0,
                 draft_vocab: int = 0):
        """draft_vocab: the size of the vocabulary the heads draft from (0: the whole vocabulary)."""
        super().__init__()
        if heads < 1:
            raise InputError(f"Medusa needs at least one head, got {heads}")
        self.hidden_size, self.vocab_size, self.base_model, self.layer_count = hidden_size, vocab_size, base_model, layer_count
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden_size, hidden_size) for _ in range(heads))
        for block in self.blocks:
            torch.nn.init.zeros_(block.weight)  # untrained: each head repeats the target's next-token guess
            torch.nn.init.zeros_(block.bias)
        self.register_buffer("vocab", torch.zeros(draft_vocab, dtype=torch.long))  # the draft vocabulary's ids

    def __len__(self) -> int:
        return len(self.blocks)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(K, .., d) every head's state from the target's features (.., d); an LM head turns them into logits."""
        features = features.to(self.blocks[0].weight.dtype)
        return torch.stack([features + torch.nn.functional.silu(block(features)) for block in self.blocks])

    def lm_head(self, model) -> DraftLMHead:
        """The model's LM head cut to the heads' draft vocabulary."""
        return DraftLMHead(model.get_output_embeddings(), self.vocab)

    def describe_shape(self) -> dict:
        return {"hidden_size": self.hidden_size, "layer_count": self.layer_count, "vocab_size": self.vocab_size}

    def save(self, folder) -> None:
        save_heads(self, folder, NAME, {"heads": len(self), "base_model": self.base_model, **self.describe_shape(),
                                        "draft_vocab": len(self.vocab)})

    @classmethod
    def load(cls, folder, model=None) -> "MedusaHeads":
        return load_heads(cls, folder, NAME, "accelgen train medusa", model)
