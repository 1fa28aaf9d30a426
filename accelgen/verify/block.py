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

from accelgen.draft import Draft, Verdict, to_device
from accelgen.errors import InputError
from accelgen.sampling import draw, uniforms
from accelgen.verify.sampling import draft_distributions


def verify_block(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """Block verification of a chain draft, decided on target_probs' device with one host read.

    draft.draft_probs: (g, vocab), row i = q(. | tokens before node i); None for a deterministic draft (a point
    mass on each drafted token). target_probs: (g+1, vocab), row i = p(. | tokens before node i), row g after
    the last draft token (already temperature/top-k/top-p).
    """
    if not draft.is_chain:
        raise InputError("block verification needs a chain draft, not a tree")
    g = len(draft)
    device = target_probs.device
    tokens = to_device(draft.tokens, device)  # (g,)
    draft_probs = draft_distributions(draft, target_probs).double()  # (g, vocab)
    target = target_probs.double()  # (g+1, vocab): the rule's products and sums compound, so float64
    weights = block_weights(target[:g].gather(1, tokens[:, None])[:, 0], draft_probs.gather(1, tokens[:, None])[:, 0])
    leftovers = _leftover(weights[:g, None], target[:g], draft_probs)  # (g, vocab) row i: after i kept tokens
    stops = stop_probabilities(weights, leftovers.sum(dim=-1))  # (g,) for i = 1..g
    passes = uniforms(g, target_probs, generator).double() <= stops
    # the largest i that passes its test wins: it may follow failed ones (0 when none passes)
    kept = torch.cat([torch.zeros(1, dtype=torch.long, device=device),
                      torch.where(passes, torch.arange(1, g + 1, device=device), 0)]).max().view(1)
    # the next token: from p after the whole block, else from norm(leftover) where the block stopped
    rows = torch.cat([leftovers, target[g:]])  # (g+1, vocab)
    row, fallback = rows.index_select(0, kept), target.index_select(0, kept)  # (1, vocab) each
    total = row.sum(dim=-1, keepdim=True)
    # nothing left only by rounding: stopping there has probability 0 in exact arithmetic
    row = torch.where(total > 0, row / total, fallback)
    next_token = draw(row.to(target_probs.dtype), generator)
    accepted_length, next_token = torch.cat([kept, next_token]).tolist()  # the one host read
    return Verdict(list(range(accepted_length)), next_token)


def block_weights(target_of_drafted: torch.Tensor, draft_of_drafted: torch.Tensor) -> torch.Tensor:
    """(g+1,) weight_0 = 1, weight_i = min(1, weight_{i-1} * p_i(x_i) / q_i(x_i)), from (g,) p_i(x_i) and (g,)
    q_i(x_i) on their device (a short loop of device operations: nothing is read back)."""
    ratios = target_of_drafted / draft_of_drafted
    weights = [torch.ones((), dtype=ratios.dtype, device=ratios.device)]
    for ratio in ratios:
        weights.append(torch.clamp(weights[-1] * ratio, max=1.0))
    return torch.stack(weights)


def stop_probabilities(weights: torch.Tensor, leftover_mass: torch.Tensor) -> torch.Tensor:
    """(g,) the probability of keeping exactly the first i tokens (given no longer prefix was kept), i = 1..g, from
    weights (g+1,) and leftover_mass (g,) = sum of leftover_i (row i: after i kept tokens)."""
    g = len(leftover_mass)
    if g == 0:
        return leftover_mass
    weight, leftover = weights[1:g], leftover_mass[1:]  # i = 1..g-1
    denominator = leftover + 1.0 - weight
    # nothing left to draw from and the block fully kept: never stop here
    inner = torch.where(denominator > 0, leftover / denominator, torch.zeros_like(leftover))
    return torch.cat([inner, weights[g:]])


def _leftover(weight: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """(..., vocab) max(0, weight * p - q): target mass the draft did not cover after a kept prefix."""
    return (weight * target_probs - draft_probs).clamp_min(0)
