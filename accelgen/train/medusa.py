"""Medusa heads (Cai et al. 2024, arXiv:2401.10774), trained on this CPU with the base model frozen.

Head k (k = 1..K) reads the target's last hidden state at position t (after its final norm) and predicts
the token at t + k + 1. The target's own LM head already predicts t + 1. A head is one residual block,
h + silu(W·h), with W starting at zero, followed by the target's LM head. Medusa-1 gives each head its own
copy of the LM head; here the copy is *shared and frozen*. On Qwen2.5-1.5B a copy would be 152k × 1536
weights (about 0.9 GB in float32) per head, and training it on a CPU would cost as much again. Only the
residual blocks train, d² weights per head. Blockwise parallel decoding (Stern et al. 2018) uses the same kind
of heads, so `blockwise` and `medusa` share them (drafters/medusa.py).

`accelgen train medusa` works in two passes:

1. It runs the frozen target once over packed windows of the dataset and keeps the final hidden states. That is
   positions × d × 4 bytes: 32k positions of the 1.5B take 200 MB.
2. It trains every head on batches of positions, with the cross-entropy on the dataset's own tokens at offset
   k + 1. Progress shows the loss and each head's top-1 accuracy.

Held-out windows give each head's top-1 and top-k accuracy (`evaluation.json`). The heads are saved as
`medusa_heads.safetensors` + `medusa_heads.json`, and refused for a model of another shape.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from accelgen.train.heads import load_heads, save_heads

NAME = "medusa_heads"


class MedusaHeads(torch.nn.Module):
    def __init__(self, heads: int, hidden_size: int, vocab_size: int = 0, base_model: str = "", layer_count: int = 0):
        super().__init__()
        if heads < 1:
            raise ValueError(f"Medusa needs at least one head, got {heads}")
        self.hidden_size, self.vocab_size, self.base_model, self.layer_count = hidden_size, vocab_size, base_model, layer_count
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden_size, hidden_size) for _ in range(heads))
        for block in self.blocks:
            torch.nn.init.zeros_(block.weight)  # untrained: each head repeats the target's next-token guess
            torch.nn.init.zeros_(block.bias)

    def __len__(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor, lm_head) -> torch.Tensor:
        """(K, .., vocab) float32 logits of every head from final hidden states (.., d)."""
        hidden = hidden.to(self.blocks[0].weight.dtype)
        states = torch.stack([hidden + torch.nn.functional.silu(block(hidden)) for block in self.blocks])
        return lm_head(states.to(lm_head.weight.dtype)).float()

    def describe_shape(self) -> dict:
        return {"hidden_size": self.hidden_size, "layer_count": self.layer_count, "vocab_size": self.vocab_size}

    def save(self, folder) -> None:
        save_heads(self, folder, NAME, {"heads": len(self), "base_model": self.base_model, **self.describe_shape()})

    @classmethod
    def load(cls, folder, model=None) -> "MedusaHeads":
        return load_heads(cls, folder, NAME, "accelgen train medusa", model)


@torch.no_grad()
def final_hidden_states(model, windows: torch.Tensor) -> torch.Tensor:
    """(count, n, d) float32: the target's last hidden states (after its final norm) over windows (count, n)."""
    states = [model.model(input_ids=window[None].to(model.device)).last_hidden_state[0].float().cpu() for window in windows]
    return torch.stack(states)


def head_targets(windows: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions (N, 2) as (window, index), targets (N, K)): every position with a token at each offset k + 1."""
    count, length = windows.shape
    usable = length - heads - 1
    if usable < 1:
        raise ValueError(f"windows of {length} tokens are too short for {heads} heads")
    index = torch.arange(usable)
    positions = torch.stack(torch.meshgrid(torch.arange(count), index, indexing="ij"), dim=-1).reshape(-1, 2)
    offsets = torch.arange(2, heads + 2)
    targets = windows[positions[:, :1], positions[:, 1:] + offsets[None]]
    return positions, targets


def train_medusa(model, windows: torch.Tensor, hidden: torch.Tensor, heads: int, *, steps: int = 300,
                 batch_size: int = 256, learning_rate: float = 1e-3, seed: int = 0,
                 progress: Callable[[dict], None] | None = None) -> MedusaHeads:
    """Train the heads' residual blocks on cached final hidden states (count, n, d) of windows (count, n)."""
    medusa = MedusaHeads(heads, model.config.hidden_size, model.config.vocab_size,
                         str(getattr(model, "name_or_path", "")), model.config.num_hidden_layers)
    positions, targets = head_targets(windows, heads)
    lm_head = model.get_output_embeddings()
    frozen = [parameter for parameter in lm_head.parameters() if parameter.requires_grad]
    for parameter in frozen:
        parameter.requires_grad_(False)
    optimizer = torch.optim.AdamW(medusa.parameters(), lr=learning_rate)
    generator = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    try:
        for step in range(steps):
            rows = torch.randint(0, len(positions), (min(batch_size, len(positions)),), generator=generator)
            states = hidden[positions[rows, 0], positions[rows, 1]]
            logits = medusa(states, lm_head)  # (K, b, vocab)
            goal = targets[rows].T  # (K, b)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), goal.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if progress is not None:
                accuracy = (logits.argmax(-1) == goal).float().mean(1)
                progress({"step": step + 1, "steps": steps, "loss": float(loss.detach()),
                          "accuracy": [float(a) for a in accuracy], "seconds": time.perf_counter() - started})
    finally:
        for parameter in frozen:
            parameter.requires_grad_(True)
    return medusa.eval()


@torch.no_grad()
def evaluate_medusa(model, medusa: MedusaHeads, windows: torch.Tensor, hidden: torch.Tensor, top_k: int = 5,
                    chunk: int = 256) -> list[dict]:
    """Per head on windows not trained on: how often its top-1, and its top-k, holds the token at offset k + 1."""
    positions, targets = head_targets(windows, len(medusa))
    top1 = torch.zeros(len(medusa))
    topk = torch.zeros(len(medusa))
    for start in range(0, len(positions), chunk):
        rows = slice(start, start + chunk)
        logits = medusa(hidden[positions[rows, 0], positions[rows, 1]], model.get_output_embeddings())
        goal = targets[rows].T[..., None]  # (K, b, 1)
        top1 += (logits.argmax(-1, keepdim=True) == goal).float().sum((1, 2))
        topk += (logits.topk(top_k, dim=-1).indices == goal).any(-1).float().sum(1)
    return [{"head": k + 1, "offset": k + 2, "top1": float(top1[k]) / len(positions),
             f"top{top_k}": float(topk[k]) / len(positions)} for k in range(len(medusa))]
