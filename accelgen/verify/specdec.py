"""SpecDec's Spec-Verification (Xia et al. 2023, arXiv:2203.16487): relaxed greedy matching, lossy by design.

Greedy verification accepts a drafted token only when it is the target's top-1. Spec-Verification also
accepts a token that is "good enough": among the target's top-beta tokens, with a log-probability at most
tau below the top-1's,

    accept x_i  iff  rank_i(x_i) < beta  and  log p_i(top-1) - log p_i(x_i) <= tau

and keeps the longest prefix of accepted tokens; the next token is the target's top-1 after that prefix
(the correction at the first rejected position, or the bonus token after a fully accepted draft).
Ranks break ties by the lower token id, as argmax does, so beta = 1 accepts exactly the argmax and the
rule is plain greedy verification whatever tau; tau = 0 accepts only tokens tied with the top-1.
Raising beta or tau can only accept more.
"""

from __future__ import annotations

import torch

from accelgen.draft import Draft, Verdict, to_device
from accelgen.errors import InputError


def check_specdec_options(beta, tau) -> None:
    if isinstance(beta, bool) or not isinstance(beta, int) or beta < 1:
        raise InputError(f"specdec: beta (top-beta tokens accepted) must be an integer >= 1, got {beta!r}")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau >= 0:
        raise InputError(f"specdec: tau (log-probability tolerance) must be a number >= 0, got {tau!r}")


def relaxed_matches(target_logits: torch.Tensor, tokens: torch.Tensor, beta: int, tau: float) -> torch.Tensor:
    """(n,) bool: whether each drafted token passes Spec-Verification on its own.

    target_logits: (n, vocab), row i scores the position of tokens[i]; tokens: (n,) long.
    """
    drafted = target_logits.gather(-1, tokens[:, None])  # (n, 1)
    ids = torch.arange(target_logits.shape[-1], device=target_logits.device)
    # tokens ranked above the drafted one; ties go to the lower id, as argmax does
    ahead = (target_logits > drafted) | ((target_logits == drafted) & (ids < tokens[:, None]))
    rank = ahead.sum(dim=-1)  # (n,) 0 for the argmax
    log_probs = torch.log_softmax(target_logits.float(), dim=-1)
    gap = log_probs.max(dim=-1).values - log_probs.gather(-1, tokens[:, None]).squeeze(-1)  # (n,) >= 0
    return (rank < beta) & (gap <= tau)


def verify_specdec(draft: Draft, target_logits: torch.Tensor, beta: int, tau: float) -> Verdict:
    """Spec-Verification of a chain draft; target_logits: (n+1, vocab), row i at the position of node i,
    row n after the last drafted token."""
    if not draft.is_chain:
        raise InputError("specdec verification needs a chain draft, not a tree")
    n = len(draft)
    tokens = to_device(draft.tokens, target_logits.device)
    passes = relaxed_matches(target_logits[:n], tokens, beta, tau)
    read = torch.cat([passes.long(), target_logits.argmax(dim=-1)]).tolist()  # the one host read: (n,) then (n+1,)
    passes, target_choice = read[:n], read[n:]
    accepted_length = passes.index(0) if 0 in passes else n
    return Verdict(list(range(accepted_length)), target_choice[accepted_length])
