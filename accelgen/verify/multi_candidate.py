"""Multi-candidate verification for candidates drawn without replacement (Yang et al. 2024, MCSD).

MCSD draws the k children of a node from the draft distribution q *without replacement*: the first from q,
the second from q with the first token removed and renormalised, and so on, so no verification slot is
wasted on a duplicate. Verification is SpecInfer's multi-step rule with one change: child j is judged
against the distribution it was actually drawn from,

    q_j = norm(q with the tokens of children 1..j-1 set to 0),

accepted with probability min(1, p_j(x_j) / q_j(x_j)); on rejection p_{j+1} = norm(max(0, p_j - q_j)).
Why this is exact: the usual argument only needs x_j ~ q_j given everything before it, and a rejected x_j
always has q_j(x_j) > p_j(x_j), so the residual p_{j+1} puts no mass on it: removing it from the next draw
loses nothing the target still needs.

Worked example, q = [0.5, 0.3, 0.2], children drawn in the order 0, 2:
    row of child 1 (token 0):  [0.5, 0.3, 0.2]
    row of child 2 (token 2):  [0,   0.6, 0.4]     (token 0 removed, renormalised)
"""

from __future__ import annotations

import torch

from accelgen.draft import Draft, Verdict, children, to_device
from accelgen.errors import InputError
from accelgen.verify.sampling import verify_speculative_sampling


def without_replacement_rows(draft: Draft) -> torch.Tensor:
    """(n, vocab): the distribution each node was drawn from, given draft.draft_probs[i] = q at i's parent.

    Siblings are taken in node order; each row is q with the earlier siblings' tokens removed, renormalised (on
    the rows' device, reading nothing back: the drafter draws no more children than the support holds, so a row
    always keeps some mass).
    """
    if draft.draft_probs is None:
        raise InputError("verification without replacement needs the draft distributions (draft_probs)")
    tokens = draft.tokens.tolist()  # host-built: the draft's own tokens
    removed_rows, removed_tokens = [], []  # (child, token of an earlier sibling) pairs to zero
    for siblings in children(draft.parents).values():
        for j, child in enumerate(siblings):
            earlier = [tokens[s] for s in siblings[:j]]
            if len(set(earlier + [tokens[child]])) != j + 1:
                raise InputError(f"siblings drawn without replacement repeat a token ({tokens[child]})")
            removed_rows += [child] * len(earlier)
            removed_tokens += earlier
    rows = draft.draft_probs.clone()  # (n, vocab)
    device = rows.device
    rows.index_put_((to_device(removed_rows, device), to_device(removed_tokens, device)),
                    torch.zeros((), dtype=rows.dtype, device=device))
    return rows / rows.sum(dim=-1, keepdim=True)


def verify_without_replacement(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """Multi-candidate speculative sampling for siblings drawn without replacement.

    draft.draft_probs: (n, vocab), row i = the draft distribution q at node i's parent (shared by siblings).
    target_probs: (n+1, vocab), row 0 at the root and row i+1 after node i.
    The committed tokens are distributed exactly as sampling from the target would give.
    """
    if not len(draft):  # nothing drafted: sample the target
        return verify_speculative_sampling(draft, target_probs, generator)
    drawn_from = Draft(draft.tokens, draft.parents, without_replacement_rows(draft))
    return verify_speculative_sampling(drawn_from, target_probs, generator)

