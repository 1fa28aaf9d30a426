"""The analytical model of speculative decoding (Leviathan et al. 2023), used to predict and to choose γ.

α: the probability that the target accepts a draft token (assumed the same for every position);
γ: draft tokens per step; c: the time of one draft forward over the time of one target forward;
r: the time of the target's verification forward over γ + 1 tokens over a one-token forward.
"""

from __future__ import annotations

from typing import Callable


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
               verify_ratio: Callable[[int], float] = lambda tokens: 1.0) -> int:
    """The γ in 1..max_gamma with the highest predicted speedup (the smallest such γ on ties).

    verify_ratio(k): r for a verification forward over k tokens (default: 1, Leviathan et al.'s assumption)."""
    return max(range(1, max_gamma + 1),
               key=lambda gamma: (predicted_speedup(alpha, gamma, cost_ratio, verify_ratio(gamma + 1)), -gamma))
