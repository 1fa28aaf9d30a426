"""Block verification (Sun et al. 2024, arXiv:2403.10444): accept a chain draft as a block, not token by token.

Token-wise speculative sampling stops at the first rejected token. Block verification looks at the whole
block: a prefix may be kept even when a token inside it would have been rejected on its own, because the
draft "over-covered" the target earlier. With the draft x_1..x_g, draft distributions q_i = q(. | x_<i) and
target distributions p_i = p(. | x_<i) (p_{g+1} after the last token):

    weight_0 = 1,  weight_i = min(1, weight_{i-1} * p_i(x_i) / q_i(x_i))
    leftover_i(x) = max(0, weight_i * p_{i+1}(x) - q_{i+1}(x))                    (i < g)
    stop_i  = sum(leftover_i) / (sum(leftover_i) + 1 - weight_i)  (i < g),   stop_g = weight_g

With independent uniforms u_1..u_g, the accepted length is the largest i with u_i <= stop_i (0 if none).
The next token is drawn from p_{g+1} when the whole block is accepted, else from norm(leftover_i) at the
accepted length i (for i = 0 that is the usual residual norm(max(0, p_1 - q_1))).

The paper proves the committed tokens follow the target exactly and that the expected number of accepted
tokens is optimal, never below token-wise verification; it uses the same model outputs, no extra calls.
On one-hot (greedy) targets and drafts it accepts exactly the longest matching prefix, like verify_greedy.
"""

from __future__ import annotations

import torch

from accelgen.draft import Draft, Verdict
from accelgen.sampling import sample


def verify_block(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """Block verification of a chain draft.

    draft.draft_probs: (g, vocab), row i = q(. | tokens before node i); None for a deterministic draft (a point
    mass on each drafted token). target_probs: (g+1, vocab), row i = p(. | tokens before node i), row g after
    the last draft token (already temperature/top-k/top-p).
    """
    if not draft.is_chain:
        raise ValueError("block verification needs a chain draft, not a tree")
    g = len(draft)
    draft_probs = _draft_distributions(draft, target_probs)  # (g, vocab)
    tokens = draft.tokens.tolist()
    weights = [1.0]  # weights[i] after i accepted-candidate tokens
    for i, token in enumerate(tokens):
        ratio = float(target_probs[i, token]) / float(draft_probs[i, token])
        weights.append(min(1.0, weights[-1] * ratio))
    uniforms = torch.rand(g, generator=generator).tolist()
    accepted_length = 0
    for i in range(1, g + 1):  # the largest i that passes its test wins: it may follow failed ones
        if uniforms[i - 1] <= _stop_probability(i, g, weights[i], target_probs, draft_probs):
            accepted_length = i
    accepted = list(range(accepted_length))
    if accepted_length == g:
        return Verdict(accepted, sample(target_probs[g], generator))
    leftover = _leftover(weights[accepted_length], target_probs[accepted_length], draft_probs[accepted_length])
    if leftover.sum() <= 0:  # only by rounding: stopping here has probability 0 in exact arithmetic
        return Verdict(accepted, sample(target_probs[accepted_length], generator))
    return Verdict(accepted, sample(leftover / leftover.sum(), generator))


def _stop_probability(i: int, g: int, weight: float, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> float:
    """Probability of keeping exactly the first i tokens (given no longer prefix was kept)."""
    if i == g:
        return weight
    leftover = float(_leftover(weight, target_probs[i], draft_probs[i]).sum())
    denominator = leftover + 1.0 - weight
    return leftover / denominator if denominator > 0 else 0.0  # nothing left to draw from: never stop here


def _leftover(weight: float, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """(vocab,) max(0, weight * p - q): target mass the draft did not cover after a kept prefix."""
    return (weight * target_probs.double() - draft_probs.double()).clamp_min(0)


def _draft_distributions(draft: Draft, like: torch.Tensor) -> torch.Tensor:
    if draft.draft_probs is not None:
        return draft.draft_probs.to(like.dtype)
    point_masses = torch.zeros(len(draft), like.shape[-1], dtype=like.dtype)
    point_masses[torch.arange(len(draft)), draft.tokens] = 1.0
    return point_masses
