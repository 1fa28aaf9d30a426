"""Big Little Decoder's rollback policy (Kim et al. 2023, arXiv:2302.07863), greedy: lossy by design.

The small (draft) model's tokens are scored by the large (target) model in one forward. A small-model token
x_i is rolled back when the large model disagrees with it by more than the rollback threshold, measured as
the paper does by the cross-entropy of the small model's token under the large model's distribution:

    d_i = -log p_large,i(x_i)        roll back at the first i with d_i > rollback_threshold

Everything from the first rolled-back token on is discarded and replaced by the large model's own (greedy)
token there; when nothing is rolled back, the large model's token after the draft is committed too (the
fallback token: the small model stopped because it was unsure, or at its length limit). A token equal to the
large model's argmax is never rolled back: replacing it by itself would only throw away the tokens after it.
So rollback_threshold = 0 (any disagreement rolls back) is exactly greedy verification.
"""

from __future__ import annotations

import torch

from accelgen.draft import Draft, Verdict, to_device
from accelgen.errors import InputError


def rollback_distances(target_logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(n,) -log p_large(x_i): cross-entropy of each small-model token under the large model's distribution.

    target_logits: (n, vocab), row i scores the position of tokens[i]; tokens: (n,) long.
    """
    return -torch.log_softmax(target_logits.float(), dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def verify_bild(draft: Draft, target_logits: torch.Tensor, rollback_threshold: float) -> Verdict:
    """BiLD's rollback rule on a chain draft; target_logits: (n+1, vocab), row i at the position of node i,
    row n after the last drafted token."""
    if not draft.is_chain:
        raise InputError("BiLD verification needs a chain draft, not a tree")
    n = len(draft)
    tokens = to_device(draft.tokens, target_logits.device)
    target_choice = target_logits.argmax(dim=-1)  # (n+1,)
    kept = (tokens == target_choice[:n]) | (rollback_distances(target_logits[:n], tokens) <= rollback_threshold)
    read = torch.cat([kept.long(), target_choice]).tolist()  # the one host read: (n,) then (n+1,)
    kept, target_choice = read[:n], read[n:]
    accepted_length = kept.index(0) if 0 in kept else n
    return Verdict(list(range(accepted_length)), target_choice[accepted_length])
