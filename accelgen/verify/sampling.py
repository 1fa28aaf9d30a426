"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), on chains and trees.

At each node the children are tried in order. Child x, drawn from the draft distribution q, is accepted with
probability min(1, p(x) / q(x)), where p is the target distribution still to be matched. On rejection p becomes
the residual norm(max(0, p - q)) and the next sibling is tried; when no child is accepted, the recovered
token is drawn from the current p. After a fully accepted path the bonus token is drawn from the target's
distribution at its end. On a chain this is exactly the Leviathan/Chen rule; on a tree whose siblings were
drawn independently from the same q it is SpecInfer's multi-step speculative sampling. Drafts without
draft_probs (n-gram, retrieval) are deterministic: q is a point mass on the drafted token.

Either way the committed tokens are distributed exactly as sampling from the target would give.

Two implementations of the one rule:

- `verify_speculative_sampling` decides on the device, with one host read for the whole verdict. The tests a
  walk down the tree could make are fixed by the tree alone: child j of a node is only tried once its siblings
  0..j-1 were all rejected, so it is always tested against the same p, the node's target row less the draft rows
  of those siblings (residual after residual). So every child's test is computed at once with its own uniform
  (u·q(x) < p(x)), the walk follows from the root the first passing child of each node, and the token after the
  walk's last node is drawn from that node's residual after all its children (its target row when it has none).
  Tests the walk never reaches use uniforms nobody looks at: the law of the verdict is the walk's.
- `verify_node_by_node` walks the tree as the rule is stated, one test at a time (a host read each): the slow,
  obviously correct reference the first is tested against.

Worked example, a chain of 3 with tests [pass, fail, pass]: the walk accepts node 0, rejects node 1 (node 2 is
never tried), and draws the next token from residual(p_1, q_1): accepted [0].
"""

from __future__ import annotations

import functools

import torch

from accelgen.draft import ROOT, Draft, Verdict, children, depths, to_device, tree_attention
from accelgen.sampling import draw, sample, uniforms


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target_probs - draft_probs)) per row, (..., vocab); a row where they coincide stays target_probs
    (nothing is left over: only rounding can ever make it drawn from)."""
    leftover = (target_probs - draft_probs).clamp_min(0)
    total = leftover.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, leftover / total, target_probs)


def verify_speculative_sampling(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """target_probs: (n+1, vocab), row 0 at the root and row i+1 after node i (already temperature/top-k/top-p).
    Decided on target_probs' device; one host read (see the module docstring)."""
    n = len(draft)
    if n == 0:  # nothing drafted: sample the target
        return Verdict([], sample(target_probs[0], generator))
    shape = tree_shape(tuple(draft.parents.tolist()))
    device = target_probs.device
    tokens = to_device(draft.tokens, device)  # (n,)
    draft_probs = draft_distributions(draft, target_probs)  # (n, vocab)
    tested, before_last = sibling_residuals(target_probs, draft_probs, tokens, shape)
    passes = uniforms(n, target_probs, generator) * draft_probs.gather(1, tokens[:, None])[:, 0] < tested
    on_path = accepted_path(passes, shape)  # (n,) bool
    last_row = deepest_row(on_path, shape)  # (1,) the row of the walk's last node (0: the root)
    next_token = draw(all_rejected(before_last, draft_probs, last_row, shape), generator)  # (1,)
    verdict = torch.cat([on_path.long(), next_token]).tolist()  # the one host read
    return Verdict([node for node in range(n) if verdict[node]], verdict[n])


class TreeShape:
    """What the on-device rule needs of a tree's shape, built on the host once per shape. Rows are the logits
    rows: the root's 0, node i's i + 1. Example, parents (-1, 0, -1):

        rounds        rank 0: rows [0, 1], nodes [0, 1], then the root's rank-0 child 0 is taken out of row 0
                      rank 1: rows [0],    nodes [2]
        last_child    [2, 1, 0, 0]  (a leaf's entry is unused: has_children [1, 1, 0, 0])
    """

    def __init__(self, parents: tuple[int, ...]):
        n = len(parents)
        kids = children(torch.tensor(parents, dtype=torch.long))
        most = max(len(siblings) for siblings in kids.values())
        # per sibling rank: (parent rows with a child of that rank, those children, the rows with a next sibling
        # to try, and the child of this rank there, whose draft row they lose)
        self.rounds = []
        for rank in range(most):
            having = [(parent, siblings) for parent, siblings in kids.items() if len(siblings) > rank]
            going_on = [(parent, siblings) for parent, siblings in having if len(siblings) > rank + 1]
            self.rounds.append(([parent + 1 for parent, _ in having], [siblings[rank] for _, siblings in having],
                                [parent + 1 for parent, _ in going_on], [siblings[rank] for _, siblings in going_on]))
        self.last_child = [kids[row - 1][-1] if kids[row - 1] else 0 for row in range(n + 1)]
        self.has_children = torch.tensor([bool(kids[row - 1]) for row in range(n + 1)])
        self.depths = depths(torch.tensor(parents, dtype=torch.long))
        self.earlier_siblings = torch.zeros(n, n, dtype=torch.bool)  # [i, j]: j is an earlier sibling of i
        for siblings in kids.values():
            for rank, child in enumerate(siblings):
                self.earlier_siblings[child, siblings[:rank]] = True
        self.ancestry = tree_attention(torch.tensor(parents, dtype=torch.long))[1:, 1:]  # [i, j]: j is i or above it


@functools.lru_cache(maxsize=256)
def tree_shape(parents: tuple[int, ...]) -> TreeShape:
    return TreeShape(parents)


def sibling_residuals(target_probs: torch.Tensor, draft_probs: torch.Tensor, tokens: torch.Tensor,
                      shape: TreeShape) -> tuple[torch.Tensor, torch.Tensor]:
    """(n,) the p(x) each node's token is tested against: its parent's target row less the draft rows of its earlier
    siblings; and (n+1, vocab) each row less the draft rows of all its children but the last (the row itself when
    it has at most one child).

    target_probs: (n+1, vocab), draft_probs: (n, vocab), tokens: (n,) long, on one device. One round per sibling
    rank, all parents' children of that rank at once; a chain needs no residual at all."""
    device = target_probs.device
    current = target_probs  # row r: p at row r less the children of r tried so far (copied once a row changes)
    tested = torch.empty(len(tokens), dtype=target_probs.dtype, device=device)
    for rows, nodes, going_on, tried in shape.rounds:
        rows, nodes = to_device(rows, device), to_device(nodes, device)
        drafted = tokens.index_select(0, nodes)[:, None]
        tested.index_copy_(0, nodes, current.index_select(0, rows).gather(1, drafted)[:, 0])
        if going_on:  # the next siblings are tried against what the ones of this rank left
            going_on, tried = to_device(going_on, device), to_device(tried, device)
            current = current.clone() if current is target_probs else current
            left = residual(current.index_select(0, going_on), draft_probs.index_select(0, tried))
            current.index_copy_(0, going_on, left)
    return tested, current


def accepted_path(passes: torch.Tensor, shape: TreeShape) -> torch.Tensor:
    """(n,) bool: the nodes the walk accepts, given (n,) bool whether each node's test passes (on its device).

    The walk takes, below each accepted node (and the root), the first child that passes; a node is on the path
    when it and each of its ancestors is the first passing child of its parent."""
    earlier_siblings = shape.earlier_siblings.to(passes.device, non_blocking=True)
    ancestry = shape.ancestry.to(passes.device, non_blocking=True)
    first_passing = passes & ~(earlier_siblings & passes[None, :]).any(dim=1)
    return ~(ancestry & ~first_passing[None, :]).any(dim=1)


def deepest_row(on_path: torch.Tensor, shape: TreeShape) -> torch.Tensor:
    """(1,) long: the logits row of the walk's last node (node i is row i + 1; 0, the root's, when it accepted
    nothing), given on_path (n,) bool on its device."""
    node_depths = to_device(shape.depths, on_path.device)
    # the root at depth 0 and every node off the path below it: the deepest node on the path wins
    depth_on_path = torch.cat([torch.zeros(1, dtype=torch.long, device=on_path.device),
                               torch.where(on_path, node_depths, -1)])
    return depth_on_path.argmax().view(1)


def all_rejected(before_last: torch.Tensor, draft_probs: torch.Tensor, row: torch.Tensor,
                 shape: TreeShape) -> torch.Tensor:
    """(1, vocab): the walk's distribution at `row` (1,) once every child there was rejected: the row less the draft
    rows of all its children (before_last less its last child's; the target row itself at a leaf)."""
    device = before_last.device
    last_child = to_device(shape.last_child, device).index_select(0, row)
    has_children = shape.has_children.to(device, non_blocking=True).index_select(0, row).to(before_last.dtype)
    return residual(before_last.index_select(0, row), draft_probs.index_select(0, last_child) * has_children[:, None])


def verify_node_by_node(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """The reference: the same rule as verify_speculative_sampling, walking the tree one test at a time.
    target_probs: (n+1, vocab), row 0 at the root and row i+1 after node i (already temperature/top-k/top-p)."""
    tokens = draft.tokens.tolist()
    kids = children(draft.parents)
    node, accepted = ROOT, []
    probs = target_probs[0]
    while True:
        for child in kids[node]:
            token = tokens[child]
            draft_probs = _draft_distribution(draft, child, probs)
            # accept with probability min(1, p/q): compare u*q < p to avoid dividing by q
            if uniforms(1, probs, generator)[0] * draft_probs[token] < probs[token]:
                accepted.append(child)
                node = child
                probs = target_probs[child + 1]
                break
            probs = residual(probs, draft_probs)
        else:
            return Verdict(accepted, sample(probs, generator))


def draft_distributions(draft: Draft, like: torch.Tensor) -> torch.Tensor:
    """(n, vocab) the distribution each node was drawn from, in like's dtype on like's device: draft.draft_probs,
    or for a deterministic draft a point mass on each drafted token."""
    if draft.draft_probs is not None:
        return draft.draft_probs.to(device=like.device, dtype=like.dtype)
    tokens = to_device(draft.tokens, like.device)
    point_masses = torch.zeros(len(draft), like.shape[-1], dtype=like.dtype, device=like.device)
    return point_masses.scatter_(1, tokens[:, None], 1.0)


def _draft_distribution(draft: Draft, node: int, like: torch.Tensor) -> torch.Tensor:
    if draft.draft_probs is not None:
        return draft.draft_probs[node].to(device=like.device, dtype=like.dtype)
    point_mass = torch.zeros_like(like)
    point_mass[int(draft.tokens[node])] = 1.0
    return point_mass
