"""SpecTr's K-SEQ draft selection (Sun et al. 2023, arXiv:2310.15141): exact verification of K i.i.d. drafts.

Given K candidates x_1..x_K drawn i.i.d. from the draft distribution q, pick one that is distributed exactly
as the target p, accepting a candidate as often as possible. K-SEQ tries the candidates in order and accepts
x_i with probability min(1, p(x_i) / (rho * q(x_i))); the first accepted one is the output, and when none is
accepted the output is drawn from a residual distribution. With

    accept(x) = min(q(x), p(x) / rho)       one candidate is x and is accepted
    beta      = sum_x accept(x)             one candidate is accepted
    scale     = 1 + (1-beta) + ... + (1-beta)^(K-1) = (1 - (1-beta)^K) / beta

the output is x after an acceptance with probability accept(x) * scale. That never exceeds p(x) when
scale <= rho, and then the residual norm(p - accept * scale) fills in the rest, so the output follows p
exactly. rho = K is always safe; a smaller rho accepts more. rho = 1 is ordinary speculative sampling, safe
for K = 1 only. The paper's rho* solves scale(beta(rho)) = rho, found here by bisection (any safe rho keeps the
rule exact; the bisection only decides how close to the best acceptance rate we get).

Multi-token drafts: K i.i.d. draft *sequences* hang below the root as sibling chains (duplicates stay separate
nodes). After a token x is selected at some depth, every sequence that spelled the accepted tokens so far
continues, and their next tokens are again i.i.d. draws from q at that prefix, however many there are: the
selection looked only at earlier tokens. So K-SEQ runs again over the children of all those nodes, with K =
their count. Worked example, K = 3 sequences (a b), (a c), (d e):

    root ─ a(0) ─ b(3)        level 1: candidates a, a, d           (K = 3)
         ├ a(1) ─ c(4)        a selected: level 2 candidates b, c   (K = 2, children of nodes 0 and 1)
         └ d(2) ─ e(5)        c selected: accepted path [1, 4]
"""

from __future__ import annotations

import bisect

import torch

from accelgen.draft import ROOT, Draft, Verdict, children
from accelgen.errors import InputError
from accelgen.sampling import sample, uniforms

BISECTION_STEPS = 16  # rho within (K - 1) / 2^16 of the best safe value: a negligible loss in acceptance


def acceptance_scale(draft_probs: torch.Tensor, target_probs: torch.Tensor, num_drafts: int) -> float:
    """The smallest safe rho in [1, num_drafts] (to bisection precision); draft_probs, target_probs: (vocab,).

    Safe means scale(beta(rho)) <= rho. rho = num_drafts is always safe, and the bisection keeps its upper end
    safe, so the returned value is safe whatever the shape of the safe set.
    """
    if num_drafts == 1:  # plain speculative sampling
        return 1.0
    beta = _acceptance_curve(draft_probs, target_probs)

    def safe(rho: float) -> bool:
        return _geometric_sum(1.0 - beta(rho), num_drafts) <= rho

    if safe(1.0):  # only when the draft equals the target
        return 1.0
    low, high = 1.0, float(num_drafts)
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        if safe(middle):
            high = middle
        else:
            low = middle
    return high


def _acceptance_curve(draft_probs: torch.Tensor, target_probs: torch.Tensor):
    """beta(rho) = sum_x min(q(x), p(x) / rho) as a cheap function of rho: one sort, then O(log vocab) a call.

    With tokens sorted by p/q, those with p/q < rho contribute p/rho and the others q; tokens the draft never
    draws (q = 0) contribute nothing.
    """
    drawable = draft_probs > 0
    draft_probs, target_probs = draft_probs[drawable].double(), target_probs[drawable].double()
    ratios, order = torch.sort(target_probs / draft_probs)
    target_below = [0.0] + torch.cumsum(target_probs[order], 0).tolist()  # [j]: sum of p over the j smallest ratios
    draft_below = [0.0] + torch.cumsum(draft_probs[order], 0).tolist()
    ratios = ratios.tolist()

    def beta(rho: float) -> float:
        below = bisect.bisect_left(ratios, rho)  # number of tokens with p/q < rho
        return target_below[below] / rho + (draft_below[-1] - draft_below[below])

    return beta


def k_seq_residual(draft_probs: torch.Tensor, target_probs: torch.Tensor, num_drafts: int, rho: float) -> torch.Tensor:
    """(vocab,) the law of the output when no candidate was accepted: norm(p - accept * scale)."""
    accept = torch.minimum(draft_probs, target_probs / rho)
    leftover = (target_probs - accept * _geometric_sum(1.0 - float(accept.sum()), num_drafts)).clamp_min(0)
    total = leftover.sum()
    # nothing left only by rounding (every draw would have been accepted): fall back to the target itself
    return leftover / total if total > 0 else target_probs


def k_seq(candidates: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
          generator: torch.Generator | None) -> tuple[int | None, int]:
    """K-SEQ over candidate tokens drawn i.i.d. from draft_probs (vocab,): (index of the accepted candidate or
    None, the selected token), the token distributed exactly as target_probs (vocab,)."""
    rho = acceptance_scale(draft_probs, target_probs, len(candidates))
    for index, token in enumerate(candidates):
        # accept with probability min(1, p / (rho q)): compare u*rho*q < p to avoid dividing by q
        if uniforms(1, target_probs, generator)[0] * rho * draft_probs[token] < target_probs[token]:
            return index, token
    return None, sample(k_seq_residual(draft_probs, target_probs, len(candidates), rho), generator)


def verify_spectr(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """K-SEQ verification of sibling chains drawn i.i.d. from the draft model (see the module docstring).

    draft.draft_probs: (n, vocab), row i = the draft distribution q at node i's parent (required).
    target_probs: (n+1, vocab), row 0 at the root and row i+1 after node i (already temperature/top-k/top-p).
    The committed tokens are distributed exactly as sampling from the target would give. With one sequence
    this is Leviathan/Chen speculative sampling, draw for draw.
    """
    if len(draft) and draft.draft_probs is None:
        raise InputError("SpecTr verification needs the draft distributions (draft_probs) of sampled drafts")
    tokens = draft.tokens.tolist()
    parents = draft.parents.tolist()
    kids = children(draft.parents)
    node, accepted = ROOT, []
    following = [ROOT]  # every node whose path spells the accepted tokens (duplicated sequences)
    while True:
        probs = target_probs[node + 1]
        candidates = sorted(child for parent in following for child in kids[parent])
        if not candidates:  # every sequence through here ended: the bonus token
            return Verdict(accepted, sample(probs, generator))
        # all candidates were drawn from q at the same prefix: one row stands for them all
        drawn_from = draft.draft_probs[candidates[0]].to(device=probs.device, dtype=probs.dtype)
        chosen, token = k_seq([tokens[c] for c in candidates], drawn_from, probs, generator)
        if chosen is None:
            return Verdict(accepted, token)
        node = candidates[chosen]
        accepted = _path_to(node, parents)  # its ancestors spell the same tokens as the path so far
        following = [c for c in candidates if tokens[c] == token]


def _geometric_sum(ratio: float, terms: int) -> float:
    """1 + ratio + ... + ratio^(terms-1): exactly 1.0 for one term, terms for ratio 1 (no division by 1 - ratio)."""
    total, power = 0.0, 1.0
    for _ in range(terms):
        total += power
        power *= ratio
    return total


def _path_to(node: int, parents: list[int]) -> list[int]:
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]
