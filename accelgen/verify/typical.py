"""Medusa's typical acceptance (Cai et al. 2024, arXiv:2401.10774): relaxed tree verification, lossy by design.

A drafted token x is accepted where the target's distribution is p (temperature 1) if

    p(x) > min(epsilon, delta · exp(−H(p)))

with H the entropy of p: where the target is sure, only a token it finds likely passes; where it hesitates
between many, a less likely one passes too. The longest root-to-node path whose every token passes is kept
(the first such node on a tie), and the next token is the target's argmax after it. Raising epsilon or delta
can only accept less; Medusa's defaults are epsilon 0.09, delta 0.3.
"""

from __future__ import annotations

import torch

from accelgen.draft import Draft, Verdict, depths, to_device
from accelgen.errors import InputError


def check_typical_options(epsilon, delta) -> None:
    for name, value in (("epsilon", epsilon), ("delta", delta)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value:
            raise InputError(f"typical acceptance: {name} must be a number >= 0, got {value!r}")


def typical_passes(target_logits: torch.Tensor, draft: Draft, epsilon: float, delta: float) -> torch.Tensor:
    """(n,) bool on the logits' device: whether each node's token passes under its parent's row; target_logits
    (n+1, vocab), row 0 the root."""
    probs = torch.softmax(target_logits.float(), dim=-1)
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)  # (n+1,)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    rows = to_device(draft.parents + 1, probs.device)  # the row that scores each node: its parent's (0 for the root's)
    tokens = to_device(draft.tokens, probs.device)
    return probs[rows, tokens] > threshold[rows]


def verify_typical(draft: Draft, target_logits: torch.Tensor, epsilon: float, delta: float) -> Verdict:
    """The deepest node whose whole path passes typical acceptance, then the target's argmax after it."""
    n = len(draft)
    passes = typical_passes(target_logits, draft, epsilon, delta)
    read = torch.cat([passes.long(), target_logits.argmax(dim=-1)]).tolist()
    passes, choices = read[:n], read[n:]  # the one host read: (n,) then the target's (n+1,) choices
    parents, levels = draft.parents.tolist(), depths(draft.parents).tolist()
    reached = []  # nodes whose path from the root passes entirely (parents come first)
    for node, parent in enumerate(parents):
        if passes[node] and (parent < 0 or parent in reached):
            reached.append(node)
    if not reached:
        return Verdict([], choices[0])
    deepest = max(reached, key=lambda node: (levels[node], -node))
    path = [deepest]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return Verdict(path[::-1], choices[deepest + 1])
