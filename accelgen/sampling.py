"""Turning logits into the distribution that is sampled: temperature, top-k, top-p; and seeded per-position noise.

The same transform is applied to target and draft logits, so speculative sampling reproduces exactly the
distribution plain sampling would draw from.

With a seed, randomness is drawn per POSITION: the token at absolute position p is argmax(log p(·) + g_p), with
g_p Gumbel noise from a stream derived from (seed, p) alone (the Gumbel-max trick: an exact sample of p). So a
seeded request's tokens do not depend on how many random numbers drafts and verification used before them:
they are the same whatever the method, the draft length or the batch (see accelgen/verify/gumbel.py).

Every draw happens on the device of the probabilities it samples and leaves its token there: reading a token back
(`int(t)`, `.tolist()`) makes the host wait for the device, so callers read once per step what they need. The
request's generator lives on the target's device (a CUDA `torch.Generator` cannot draw CPU numbers, nor the
reverse); a draw whose probabilities sit elsewhere draws its noise on the generator's device and moves it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from accelgen.errors import InputError


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
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")

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
    """One token id from a (vocab,) distribution, read back to the host (reference paths and tests; decoding steps
    keep `draw`'s token on the device)."""
    return int(draw(probs, generator))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """(..., vocab) probabilities (any positive scale per row) -> (...,) long: a token per row, drawn on the
    probabilities' device without reading anything back.

    torch.multinomial's own method for one sample: the exponential race argmax p / E, E ~ Exp(1) per token, which
    picks token i with probability p_i. multinomial also checks that the probabilities are valid, a read that makes
    the host wait for the device; this is the same draw without it (the same token from the same generator state).
    """
    return (probs / exponentials(probs, generator)).argmax(dim=-1)


def exponentials(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) draws shaped, typed and placed as `like` (drawn on the generator's device, moved if it differs)."""
    device = like.device if generator is None else generator.device
    races = torch.empty(like.shape, dtype=like.dtype, device=device).exponential_(generator=generator)
    return races.to(like.device)


def uniforms(count: int, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """(count,) U[0, 1) draws in like's dtype on like's device (drawn on the generator's device, moved if it
    differs): the acceptance tests of speculative sampling."""
    device = like.device if generator is None else generator.device
    return torch.rand(count, generator=generator, dtype=like.dtype, device=device).to(like.device)


def sampling_scores(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """(..., vocab) logits -> the scores sampling draws from, as transformers' `output_scores` reports them:
    logits / temperature with -inf where top-k or top-p removed a token; the logits themselves when greedy."""
    if config.greedy:
        return logits.float()
    tempered = logits.float() / max(config.temperature, MIN_TEMPERATURE)
    return tempered.masked_fill(logits_to_probs(logits, config) == 0, float("-inf"))


class PositionNoise:
    """Gumbel noise per absolute position: g_p (vocab,) from a stream seeded by (seed, p) alone.

    The noise is drawn on the device, and in the dtype (float32 at least), of the probabilities it perturbs, by a
    generator of that device: each kind of device has its own stream, so a seed gives the same tokens across
    methods, draft lengths and batches on one kind of device, not from a CPU to a GPU."""

    def __init__(self, seed: int, vocab_size: int):
        self.seed, self.vocab_size = seed, vocab_size
        # drafts and verification read the same positions; a step reads at most its depth + 1 of them
        self._draw_cached = functools.lru_cache(maxsize=64)(self._draw)

    def at(self, position: int, like: torch.Tensor | None = None) -> torch.Tensor:
        """(vocab,) the noise of position, on like's device in like's dtype (float32 at least; CPU float32 without)."""
        if like is None:
            return self._draw_cached(position, torch.device("cpu"), torch.float32)
        return self._draw_cached(position, like.device, torch.promote_types(like.dtype, torch.float32))

    def rows(self, positions: list[int], like: torch.Tensor | None = None) -> torch.Tensor:
        """(len(positions), vocab) the noise of each position, placed as `at` places it."""
        return torch.stack([self.at(position, like) for position in positions])

    def _draw(self, position: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        # numpy's SeedSequence mixes (seed, position) into a well-spread seed: nearby seeds give unrelated streams
        state = np.random.SeedSequence([self.seed % 2**64, position]).generate_state(2, np.uint32)
        generator = torch.Generator(device=device).manual_seed(int(state[0]) << 32 | int(state[1]))
        uniform = torch.rand(self.vocab_size, generator=generator, dtype=dtype, device=device)
        # -log(-log U) is Gumbel(0, 1); a U of 0 gives -inf, a token never chosen (U < 1: no +inf)
        return -(-uniform.log()).log()


def gumbel_choice(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """(k, vocab) probabilities (after temperature, top-k, top-p) and (k, vocab) Gumbel noise (or one (vocab,) row
    for all) -> (k,) long: argmax(log p + g), an exact sample of p when g is fresh Gumbel noise, left on the
    probabilities' device."""
    return (probs.log() + noise.to(probs.device)).argmax(dim=-1)
