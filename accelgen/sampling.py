"""Turning logits into the distribution that is sampled: temperature, top-k, top-p; and seeded per-position noise.

The same transform is applied to target and draft logits, so speculative sampling reproduces exactly the
distribution plain sampling would draw from.

With a seed, randomness is drawn per POSITION: the token at absolute position p is argmax(log p(·) + g_p), with
g_p Gumbel noise from a stream derived from (seed, p) alone (the Gumbel-max trick: an exact sample of p). So a
seeded request's tokens do not depend on how many random numbers drafts and verification used before them:
they are the same whatever the method, the draft length or the batch (see accelgen/verify/gumbel.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    # what the request's drafters share with its verification: the logits processors (accelgen/processors.py,
    # applied to a draft model's logits too, for acceptance) and, when seeded, the per-position noise
    processors: object = field(default=None, compare=False, repr=False)  # LogitsPipeline | None
    noise: "PositionNoise | None" = field(default=None, compare=False, repr=False)

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


def sampling_scores(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """(..., vocab) logits -> the scores sampling draws from, as transformers' `output_scores` reports them:
    logits / temperature with -inf where top-k or top-p removed a token; the logits themselves when greedy."""
    if config.greedy:
        return logits.float()
    tempered = logits.float() / max(config.temperature, MIN_TEMPERATURE)
    return tempered.masked_fill(logits_to_probs(logits, config) == 0, float("-inf"))


class PositionNoise:
    """Gumbel noise per absolute position: g_p (vocab,) float32 from a stream seeded by (seed, p) alone."""

    def __init__(self, seed: int, vocab_size: int):
        self.seed, self.vocab_size = seed, vocab_size
        self.at = functools.lru_cache(maxsize=256)(self._draw)  # drafts and verification read the same positions

    def _draw(self, position: int) -> torch.Tensor:
        # numpy's SeedSequence mixes (seed, position) into a well-spread seed: nearby seeds give unrelated streams
        state = np.random.SeedSequence([self.seed % 2**64, position]).generate_state(2, np.uint32)
        generator = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
        # float64 uniforms on [0, 1): a 0 (odds 2^-53) gives -inf, never chosen; float32 would give one token in
        # 2^24 an infinite score instead (an exponential_ draw of 0)
        uniform = torch.rand(self.vocab_size, generator=generator, dtype=torch.float64)
        return (-(-uniform.log()).log()).float()  # -log(-log U) is Gumbel(0, 1)

    def rows(self, positions: list[int]) -> torch.Tensor:
        """(len(positions), vocab) the noise of each position."""
        return torch.stack([self.at(position) for position in positions])


def gumbel_choice(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """(k, vocab) probabilities (after temperature, top-k, top-p) and (k, vocab) Gumbel noise -> (k,) long:
    argmax(log p + g), an exact sample of p when g is fresh Gumbel noise. The noise is drawn on the CPU (the same
    stream on every device) and moved to the probabilities' device."""
    return (probs.log() + noise.to(probs.device)).argmax(dim=-1)
