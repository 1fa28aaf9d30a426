"""Turning logits into the distribution that is sampled: temperature, top-k, top-p.

The same transform is applied to target and draft logits, so speculative sampling reproduces exactly the
distribution plain sampling would draw from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# Below this, logits / temperature overflows float32 (max 3.4e38) into inf and nan for logits beyond 3.4e8; the
# distribution is one-hot on the best token (ties aside) long before, so a smaller temperature samples as this one.
MIN_TEMPERATURE = 1e-30


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """(..., vocab) logits -> (..., vocab) float32 probabilities after temperature, top-k and top-p."""
    logits = logits.float() / max(config.temperature, MIN_TEMPERATURE)
    if config.top_k and config.top_k < logits.shape[-1]:
        kth_best = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if config.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the tokens ranked above it already reach top_p (the best token always stays)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = mass_before >= config.top_p
        drop[..., 0] = False  # also when top_p rounds to 0 in float32 (top_p 1e-300)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a (vocab,) distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))
