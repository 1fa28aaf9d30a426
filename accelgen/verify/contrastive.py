"""Speculative contrastive decoding (Yuan et al. 2023, arXiv:2311.08981), greedy: lossy by design.

Contrastive decoding (Li et al. 2023) prefers tokens the expert (target) likes much more than the amateur
(draft model) does. At each position, with expert logits s_E and amateur log-probabilities log p_A,

    score(x) = s_E(x) - alpha * log p_A(x)   for plausible x:  p_E(x) >= beta * max p_E,   -inf otherwise

and contrastive greedy decoding takes the argmax of the score. (Amateur logits and log-probabilities differ by a
constant per position, so the argmax is the same.) The speculative part: the amateur drafts greedily, and the
expert scores the whole draft in one forward; a drafted token is accepted while it equals the contrastive
argmax, and the first mismatch is replaced by the contrastive argmax. Every committed token is therefore the
contrastive greedy choice at its position, however the drafts fall.

The amateur has not scored the position after its last drafted token, so after a fully accepted draft the
contrastive choice there is unknown: the last drafted token is then committed as the step's next token
instead of as an accepted one (the same tokens; the bonus row goes unused). With alpha = 0 the score is the
expert's own logits (the expert's argmax is always plausible), the bonus is the expert's argmax, and the rule
is exactly greedy verification. An empty draft (the loop asks for none when one token is left) commits the
expert's argmax.
"""

from __future__ import annotations

import math

import torch

from accelgen.draft import Draft, Verdict
from accelgen.errors import InputError


def check_contrastive_options(alpha, beta) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha >= 0:
        raise InputError(f"contrastive: alpha (amateur weight) must be a number >= 0, got {alpha!r}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta <= 1:
        raise InputError(f"contrastive: beta (plausibility cut-off) must be a number in [0, 1], got {beta!r}")


def contrastive_scores(target_logits: torch.Tensor, draft_probs: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """(m, vocab) contrastive scores; target_logits: (m, vocab) expert logits, draft_probs: (m, vocab) the
    amateur's distributions at the same positions."""
    target_probs = torch.softmax(target_logits.float(), dim=-1)
    plausible = target_probs >= beta * target_probs.max(dim=-1, keepdim=True).values
    if alpha == 0:  # the expert alone (no log of the amateur: its zeros would give 0 * inf)
        return target_logits.masked_fill(~plausible, -math.inf)
    # the smallest positive float stands in for an amateur probability that underflowed to 0
    amateur_log_probs = torch.log(draft_probs.float().clamp_min(torch.finfo(torch.float32).tiny))
    return (target_logits - alpha * amateur_log_probs).masked_fill(~plausible, -math.inf)


def verify_contrastive(draft: Draft, target_logits: torch.Tensor, alpha: float, beta: float) -> Verdict:
    """Contrastive greedy verification of a chain draft (see the module docstring).

    draft.draft_probs: (n, vocab), row i = the amateur's distribution at the position of node i (required).
    target_logits: (n+1, vocab), row i at the position of node i, row n after the last drafted token.
    """
    if not draft.is_chain:
        raise InputError("contrastive verification needs a chain draft, not a tree")
    n = len(draft)
    if n == 0:  # no amateur view of this position: the expert decides
        return Verdict([], int(target_logits[0].argmax()))
    if draft.draft_probs is None:
        raise InputError("contrastive verification needs the amateur's distributions (draft_probs)")
    choice = contrastive_scores(target_logits[:n], draft.draft_probs, alpha, beta).argmax(dim=-1).tolist()  # (n,)
    tokens = draft.tokens.tolist()
    for i in range(n):
        if tokens[i] != choice[i]:
            return Verdict(list(range(i)), choice[i])
    if alpha == 0:  # the contrastive choice after the draft is the expert's argmax: a real bonus token
        return Verdict(list(range(n)), int(target_logits[n].argmax()))
    return Verdict(list(range(n - 1)), tokens[n - 1])
