"""Drafts as token trees given by parent indices, and what verification decides about them.

A draft hangs below the *root*: the last committed token, whose logits predict the first draft tokens.
Nodes are numbered 0..n-1 in topological order (a parent comes before its children); `parents[i]` is the
parent node of node i, or -1 when its parent is the root. A chain is the tree with parents = [-1, 0, 1, ...].

The target scores root + nodes in one forward; row 0 of its logits belongs to the root and row i+1 to node i.

Worked example, two branches after the root:   root ─ a(0) ─ b(1)
                                                    └ c(2)
    tokens  = [a, b, c]
    parents = [-1, 0, -1]
    depths  = [1, 2, 1]          (root has depth 0; positions = first uncached position + depth)
    tree_attention(parents) =    rows/cols: root a b c
        root [1 0 0 0]
        a    [1 1 0 0]
        b    [1 1 1 0]
        c    [1 0 0 1]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from accelgen.errors import InputError

ROOT = -1


@dataclass
class Draft:
    tokens: torch.Tensor  # (n,) long: candidate token ids
    parents: torch.Tensor  # (n,) long: parent node index, ROOT (-1) for children of the root
    draft_probs: torch.Tensor | None = None  # (n, vocab) float: distribution node i was drawn from; None for model-free drafts

    def __post_init__(self):
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 1:
            raise InputError(f"draft tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} must be equal 1-D shapes")
        if len(self) and bool((self.parents >= torch.arange(len(self))).any()):
            raise InputError("draft nodes must come after their parents (parents[i] < i)")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def is_chain(self) -> bool:
        return bool((self.parents == torch.arange(len(self)) - 1).all())

    @staticmethod
    def empty() -> "Draft":
        return Draft(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))

    @staticmethod
    def chain(tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> "Draft":
        """A width-1 tree: each token's parent is the one before it."""
        tokens = tokens.to(torch.long).reshape(-1)
        return Draft(tokens, torch.arange(len(tokens)) - 1, draft_probs)

    def truncated(self, max_nodes: int) -> "Draft":
        """The first max_nodes nodes (still a tree, since parents come first)."""
        if len(self) <= max_nodes:
            return self
        probs = None if self.draft_probs is None else self.draft_probs[:max_nodes]
        return Draft(self.tokens[:max_nodes], self.parents[:max_nodes], probs)


@dataclass
class Verdict:
    accepted: list[int]  # node indices of the accepted path, root-to-leaf
    next_token: int  # the target's own token after the accepted path: bonus (all accepted) or recovered

    def new_tokens(self, draft: Draft) -> list[int]:
        """The tokens this step commits: the accepted draft tokens, then next_token."""
        return [int(draft.tokens[i]) for i in self.accepted] + [self.next_token]

    def kept_rows(self) -> list[int]:
        """The rows of the scored block (root at row 0, node i at row i+1) on the accepted path: the root's, then
        each accepted node's. The KV cache keeps these, and row r's logits chose the r-th committed token."""
        return [0] + [node + 1 for node in self.accepted]


def keep_accepted(runner, root_position: int, verdict: Verdict) -> None:
    """Roll back a KV cache (a model runner's) that has just scored root + draft: it keeps the positions before
    the root, the root and the accepted path, so the token the verdict adds becomes the next root."""
    runner.keep(root_position, verdict.kept_rows())


def depths(parents: torch.Tensor) -> torch.Tensor:
    """(n,) depth of each node below the root (children of the root have depth 1)."""
    result = torch.ones(len(parents), dtype=torch.long)
    for i, parent in enumerate(parents.tolist()):
        if parent != ROOT:
            result[i] = result[parent] + 1
    return result


def tree_attention(parents: torch.Tensor, prefix: int = 1) -> torch.Tensor:
    """(prefix+n, prefix+n) bool: row r may attend to column c; ancestors and self. Read-only: it may be shared.

    The first `prefix` rows are committed tokens in causal order, the last of them the root; node i is row
    prefix+i and sees the whole prefix plus its own ancestors. prefix > 1 lets the first step of generation
    feed the prompt and the first draft in one forward.
    """
    if prefix == 1:  # every step after the first: a static tree shape repeats, so build it once
        return _tree_attention_after_root(tuple(parents.tolist()))
    return _build_tree_attention(parents.tolist(), prefix)


def causal(m: int) -> torch.Tensor:
    """(m, m) bool: the attention pattern of a chain, each token seeing itself and the ones before it."""
    return torch.ones(m, m, dtype=torch.bool).tril()


@functools.lru_cache(maxsize=256)
def _tree_attention_after_root(parents: tuple[int, ...]) -> torch.Tensor:
    return _build_tree_attention(list(parents), 1)


def _build_tree_attention(parents: list[int], prefix: int) -> torch.Tensor:
    n = len(parents)
    allowed = torch.zeros(prefix + n, prefix + n, dtype=torch.bool)
    allowed[:prefix, :prefix] = causal(prefix)
    for i, parent in enumerate(parents):
        row = prefix + i
        allowed[row] = allowed[prefix - 1 if parent == ROOT else prefix + parent]  # what its parent sees...
        allowed[row, row] = True  # ...and itself
    return allowed


def to_device(values, device) -> torch.Tensor:
    """Host-built ids (a list of ints or a CPU tensor) on `device`, (n,) long, without waiting for it: torch's
    plain host-to-device copy first waits until the device has finished all its queued work, a non-blocking one
    only stages the host memory (so the list may be dropped at once). Indexing a device tensor with a Python list
    makes the blocking kind: index with these instead."""
    ids = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long)
    return ids.to(device, non_blocking=True)


def children(parents: torch.Tensor) -> dict[int, list[int]]:
    """Map node (ROOT for the root) -> its children in order."""
    result: dict[int, list[int]] = {ROOT: []}
    for i, parent in enumerate(parents.tolist()):
        result.setdefault(parent, []).append(i)
        result.setdefault(i, [])
    return result
