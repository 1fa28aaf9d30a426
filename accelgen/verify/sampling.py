"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), on chains and trees.

At each node the children are tried in order. Child x, drawn from the draft distribution q, is accepted with
probability min(1, p(x) / q(x)), where p is the target distribution still to be matched. On rejection p becomes
the residual norm(max(0, p - q)) and the next sibling is tried; when no child is accepted, the recovered
token is drawn from the current p. After a fully accepted path the bonus token is drawn from the target's
distribution at its end. On a chain this is exactly the Leviathan/Chen rule; on a tree whose siblings were
drawn independently from the same q it is SpecInfer's multi-step speculative sampling. Drafts without
draft_probs (n-gram, retrieval) are deterministic: q is a point mass on the drafted token.

Either way the committed tokens are distributed exactly as sampling from the target would give.
"""

from __future__ import annotations

import torch

from accelgen.draft import ROOT, Draft, Verdict, children
from accelgen.sampling import sample


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target_probs - draft_probs)), (vocab,); falls back to target_probs if they coincide."""
    leftover = (target_probs - draft_probs).clamp_min(0)
    total = leftover.sum()
    return leftover / total if total > 0 else target_probs


def verify_speculative_sampling(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """target_probs: (n+1, vocab), row 0 at the root and row i+1 after node i (already temperature/top-k/top-p)."""
    tokens = draft.tokens.tolist()
    kids = children(draft.parents)
    node, accepted = ROOT, []
    probs = target_probs[0]
    while True:
        for child in kids[node]:
            token = tokens[child]
            draft_probs = _draft_distribution(draft, child, probs)
            # accept with probability min(1, p/q): compare u*q < p to avoid dividing by q
            if torch.rand((), generator=generator) * draft_probs[token] < probs[token]:
                accepted.append(child)
                node = child
                probs = target_probs[child + 1]
                break
            probs = residual(probs, draft_probs)
        else:
            return Verdict(accepted, sample(probs, generator))


def _draft_distribution(draft: Draft, node: int, like: torch.Tensor) -> torch.Tensor:
    if draft.draft_probs is not None:
        return draft.draft_probs[node].to(like.dtype)
    point_mass = torch.zeros_like(like)
    point_mass[int(draft.tokens[node])] = 1.0
    return point_mass
