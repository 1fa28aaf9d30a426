"""Greedy verification: accept draft tokens while they equal the target's argmax (chains and trees)."""

from __future__ import annotations

import torch

from accelgen.draft import ROOT, Draft, Verdict, children


def verify_greedy(draft: Draft, target_logits: torch.Tensor) -> Verdict:
    """Longest root-to-leaf path whose every token is the target's argmax, plus the target's next token.

    target_logits: (n+1, vocab); row 0 predicts the root's children, row i+1 the children of node i.
    Exact: the committed tokens are those plain greedy decoding would produce.
    """
    return follow_choices(draft, target_logits.argmax(dim=-1).tolist())


def follow_choices(draft: Draft, target_choice: list[int]) -> Verdict:
    """Walk down the draft while a child holds the target's choice at its parent's row (n+1 choices, row 0 at
    the root): the accepted path, and the target's choice after it."""
    tokens = draft.tokens.tolist()
    kids = children(draft.parents)
    node, accepted = ROOT, []
    while True:
        wanted = target_choice[node + 1]
        match = next((child for child in kids[node] if tokens[child] == wanted), None)
        if match is None:
            return Verdict(accepted, wanted)
        accepted.append(match)
        node = match
