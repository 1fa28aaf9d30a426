"""The analytical model of speculative decoding (Leviathan et al. 2023), used to predict and to choose γ.

α: the probability that the target accepts a draft token (assumed the same for every position);
γ: draft tokens per step; c: the time of one draft forward over the time of one target forward;
r: the time of the target's verification forward over γ + 1 tokens over a one-token forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar


def expected_tokens_per_forward(alpha: float, gamma: int) -> float:
    """Leviathan et al. (2023), eq. 1: E = (1 − α^(γ+1)) / (1 − α) tokens per target forward."""
    if alpha >= 1:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, gamma: int, cost_ratio: float, verify_ratio: float = 1.0) -> float:
    """Leviathan et al. (2023), theorem 3.8: S = E / (γc + 1), c = draft forward time / target forward time.

    verify_ratio r: the time of the target's forward over γ + 1 tokens over a one-token forward (Yan et al.
    2024); Leviathan et al. take it as 1, which holds while a forward is bound by reading the weights.
    """
    return expected_tokens_per_forward(alpha, gamma) / (gamma * cost_ratio + verify_ratio)


def best_gamma(alpha: float, cost_ratio: float, max_gamma: int,
               verify_ratio: Callable[[int], float] = lambda tokens: 1.0, min_gain: float = 1.0) -> int:
    """The γ in 0..max_gamma with the highest predicted speedup (the smallest such γ on ties).

    γ = 0 is plain decoding, a speedup of 1 by definition: it is chosen unless some γ is predicted more than
    min_gain times faster (min_gain > 1 leaves a margin for noisy timings). verify_ratio(k): r for a
    verification forward over k tokens (default: 1, Leviathan et al.'s assumption)."""
    def speedup(gamma: int) -> float:
        return predicted_speedup(alpha, gamma, cost_ratio, verify_ratio(gamma + 1))

    best = max(range(1, max_gamma + 1), key=lambda gamma: (speedup(gamma), -gamma), default=0)
    return best if best and speedup(best) > min_gain else 0


@dataclass
class AcceptanceEstimate:
    """α from what the target did with recent drafts: α = (accepted + 1) / (accepted + rejections + 2).

    Each verified step adds its accepted draft tokens, and one rejection if it stopped short of its draft (or
    had nothing to verify: a drafter that finds no draft gains nothing). That is the maximum-likelihood α of
    the model above (a run of acceptances ended by the first rejection), with one of each added so that it is
    never exactly 0 or 1. Old steps fade (DECAY per step), so α follows the text.
    """

    accepted: float = 0.0
    rejections: float = 0.0
    DECAY: ClassVar[float] = 0.9

    @property
    def alpha(self) -> float:
        return (self.accepted + 1) / (self.accepted + self.rejections + 2)

    @classmethod
    def starting_at(cls, alpha: float, weight: float = 2.0) -> "AcceptanceEstimate":
        """An estimate whose α is `alpha` before any step, worth `weight` observed steps (a prior)."""
        accepted = min(max(alpha * (weight + 2) - 1, 0.0), weight)
        return cls(accepted, weight - accepted)

    def observe(self, drafted: int, accepted: int) -> None:
        self.accepted = self.DECAY * self.accepted + accepted
        self.rejections = self.DECAY * self.rejections + (accepted < drafted or drafted == 0)
