"""Merging candidate continuations into one draft tree, heaviest nodes first under a node budget.

Model-free drafters (prompt lookup, LLMA, REST, lookahead decoding) find several candidate continuations of
the context. Merging their shared prefixes into a trie lets one target forward verify all of them for the
price of their distinct tokens. A node weighs the total weight of the candidates that pass through it, so a
node never weighs less than any of its children: the `max_nodes` heaviest nodes (ties go to the shallower,
then to the earlier inserted) always include their parents, and therefore form a tree.

Worked example, candidates [a b c] (weight 2) and [a d] (weight 1), max_nodes 3:

    trie   root ─ a(3) ─ b(2) ─ c(2)        kept: a, b, c  (d weighs 1)
                       └ d(1)
    draft  tokens [a, b, c], parents [-1, 0, 1]
"""

from __future__ import annotations

from typing import Sequence

import torch

from accelgen.draft import ROOT, Draft


class CandidateTree:
    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.weights: list[float] = []
        self._children: dict[int, dict[int, int]] = {ROOT: {}}  # node -> {token: child node}

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, branch: Sequence[int], weight: float = 1.0) -> None:
        """Add one candidate continuation (token ids following the root) with its weight (> 0)."""
        node = ROOT
        for depth, token in enumerate(branch, start=1):
            token = int(token)
            child = self._children[node].get(token)
            if child is None:
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.depths.append(depth)
                self.weights.append(0.0)
                self._children[node][token] = child
                self._children[child] = {}
            self.weights[child] += weight
            node = child

    def draft(self, max_nodes: int) -> Draft:
        """The heaviest max_nodes nodes as a Draft, shallow nodes first and heavier siblings first."""
        kept = sorted(range(len(self)), key=lambda i: (-self.weights[i], self.depths[i], i))[: max(max_nodes, 0)]
        kept.sort(key=lambda i: (self.depths[i], -self.weights[i], i))  # parents before children
        new_index = {old: new for new, old in enumerate(kept)}
        new_index[ROOT] = ROOT
        tokens = torch.tensor([self.tokens[i] for i in kept], dtype=torch.long)
        parents = torch.tensor([new_index[self.parents[i]] for i in kept], dtype=torch.long)
        return Draft(tokens, parents)


def draft_from_candidates(candidates: Sequence[Sequence[int]], max_nodes: int,
                          weights: Sequence[float] | None = None) -> Draft:
    """One draft tree from candidate continuations; without weights, earlier candidates strictly win
    (weight 2^-rank, so the first candidate's path is kept whole before any node of the second)."""
    if not candidates:
        return Draft.empty()
    if len(candidates) == 1:
        return Draft.chain(torch.tensor(list(candidates[0])[:max_nodes], dtype=torch.long))
    tree = CandidateTree()
    for rank, branch in enumerate(candidates):
        tree.add(branch, weights[rank] if weights is not None else 0.5**rank)
    return tree.draft(max_nodes)
