"""Lookahead decoding (Fu et al. 2024): a 2-D Jacobi window makes n-grams, an n-gram pool drafts from them.

Two branches share one target forward:

  * the lookahead branch, a window of window_size columns and ngram_size - 1 levels of guesses: level l,
    column i guesses the token at position i + l + 1 after the root. Its tokens are draft tree nodes: level 0
    is a chain from the root (the spine), and each column hangs its deeper levels below its spine node, so
    each node attends to exactly the guesses before its own position, as in the paper's attention mask:

        root ─ s0 ─ s1 ─ s2 ─ b2 ─ c2     levels[0] = [s0 s1 s2]   (positions 1 2 3)
               │    └ b1 ─ c1             levels[1] = [b0 b1 b2]   (positions 2 3 4)
               └ b0 ─ c0                  levels[2] = [c0 c1 c2]   (positions 3 4 5)

    The target's prediction after each deepest node is a new guess one position further: one Jacobi
    iteration for the whole window. Each column then reads as an n-gram along consecutive positions,
    (s_i, b_i, c_i, new_i), which goes into the pool; the levels shift up and the new guesses become the
    deepest level. While the window warms up, a level is added per step instead.
  * the verification branch: up to guess_set_size n-grams from the pool whose first token is the root
    (the most recent first), their remaining tokens merged into a tree from the root.

The pool also learns the n-grams of the prompt and of committed text. Greedy verification may accept
lookahead nodes too; that is still exact, since any accepted path equals the target's own argmax tokens
(the spine is then a Jacobi guess that happened to converge). Drafts are deterministic functions of what was
already scored, so with speculative sampling they are point masses and the method is exact for sampling too.

max_nodes caps both branches together. "auto" (the default) drafts each step only if the measured verification
cost r(k) (accelgen/costs.py) pays for the window, counted as a fixed cost, plus the pooled n-grams the running
acceptance is worth: on a CPU where verifying 8 tokens costs little more than decoding one, the window and the
guesses are drafted; where it costs several steps, nothing is (plain decoding, with rare probes). None: no
cap, as in the paper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelgen.draft import ROOT, Draft, Verdict
from accelgen.drafters.base import BuildContext, ContextCursor, Drafter
from accelgen.drafters.budget import sized_by_costs
from accelgen.drafters.candidate_tree import draft_from_candidates
from accelgen.errors import InputError
from accelgen.registry import MethodOptions, MethodSpec, Part, register


class NGramPool:
    """Up to per_key continuations (the n-gram after its first token) per first token, least recent dropped first."""

    def __init__(self, per_key: int):
        self.per_key = per_key
        self.grams: dict[int, list[tuple[int, ...]]] = {}  # first token -> continuations, most recent last

    def add(self, ngram: tuple[int, ...]) -> None:
        if self.per_key == 0:
            return
        continuations = self.grams.setdefault(ngram[0], [])
        if ngram[1:] in continuations:
            continuations.remove(ngram[1:])
        continuations.append(ngram[1:])
        if len(continuations) > self.per_key:
            del continuations[0]

    def candidates(self, first: int) -> list[tuple[int, ...]]:
        """Continuations of n-grams starting with `first`, most recent first."""
        return list(reversed(self.grams.get(first, [])))


def lookahead_nodes(levels: list[list[int]], offset: int) -> tuple[list[int], list[int], list[int]]:
    """The window as draft nodes numbered from offset: (tokens, parents, deepest node of each column).

    Spine (level 0) first as a chain from the root, then each column's deeper levels below its spine node.
    Example, 2 levels of 2 columns, offset 0: tokens [s0 s1 b0 b1], parents [-1 0 0 1], deepest [2 3].
    """
    columns = len(levels[0])
    tokens = list(levels[0])
    parents = [ROOT] + [offset + i for i in range(columns - 1)]
    deepest = []
    for column in range(columns):
        parent = offset + column
        for level in levels[1:]:
            tokens.append(level[column])
            parents.append(parent)
            parent = offset + len(tokens) - 1
        deepest.append(parent)
    return tokens, parents, deepest


def spread(tokens: list[int], count: int) -> list[int]:
    """count tokens taken evenly across tokens: a window's first guesses, copied from the prompt."""
    return [tokens[i * len(tokens) // count] for i in range(count)]


class LookaheadDecodingDrafter(Drafter):
    def __init__(self, window_size: int = 3, ngram_size: int = 3, guess_set_size: int = 2, max_nodes: int | None = None):
        if window_size < 1:
            raise InputError(f"window_size must be >= 1, got {window_size}")
        if ngram_size < 2:
            raise InputError(f"ngram_size must be >= 2, got {ngram_size}")
        if guess_set_size < 0:
            raise InputError(f"guess_set_size must be >= 0, got {guess_set_size}")
        if max_nodes is not None and max_nodes < 1:
            raise InputError(f"max_nodes must be >= 1, 'auto' or None, got {max_nodes}")
        self.max_nodes = max_nodes
        self.window_size, self.ngram_size = window_size, ngram_size
        self.pool = NGramPool(guess_set_size)
        self.levels: list[list[int]] = []  # the window; empty until the prompt is seen
        self.recent: list[int] = []  # the last ngram_size - 1 committed tokens, to pool n-grams across steps
        self.read = ContextCursor()  # context tokens already pooled
        self._deepest: list[int] | None = None  # last draft: node index of each column's deepest level

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        """context: (L,) long; the whole prompt is read once, then only the tokens committed since."""
        if self.max_nodes is not None:
            max_nodes = min(max_nodes, self.max_nodes)
        new = self.read.new_since_last(context)
        if not self.levels:  # first step: a spine long enough to lose one column per warm-up step
            self.levels = [spread(new, self.window_size + self.ngram_size - 2)]
        self._pool_committed(new)

        window_nodes = len(self.levels) * len(self.levels[0])
        with_window = window_nodes <= max_nodes  # near max_new_tokens the window does not fit: skip it
        candidates = self.pool.candidates(int(context[-1]))
        verification = draft_from_candidates(candidates, max_nodes - window_nodes if with_window else max_nodes)
        self._deepest = None
        if not with_window:
            return verification
        tokens, parents, self._deepest = lookahead_nodes(self.levels, len(verification))
        return Draft(torch.cat([verification.tokens, torch.tensor(tokens, dtype=torch.long)]),
                     torch.cat([verification.parents, torch.tensor(parents, dtype=torch.long)]))

    def _pool_committed(self, new: list[int]) -> None:
        """Pool every n-gram that ends in the new tokens."""
        text = self.recent + new
        for end in range(max(self.ngram_size, len(self.recent) + 1), len(text) + 1):
            self.pool.add(tuple(text[end - self.ngram_size : end]))
        self.recent = text[-(self.ngram_size - 1) :]

    def update(self, draft: Draft, verdict: Verdict, target_logits: torch.Tensor) -> None:
        """target_logits: (n+1, vocab); the rows after the deepest lookahead nodes are the next guesses."""
        if self._deepest is None:
            return
        guesses = target_logits[[node + 1 for node in self._deepest]].argmax(dim=-1).tolist()
        if len(self.levels) < self.ngram_size - 1:  # warming up: one more level, one column less
            self.levels = [level[1:] for level in self.levels] + [guesses[1:]]
            return
        for column, guess in enumerate(guesses):
            self.pool.add(tuple(level[column] for level in self.levels) + (guess,))
        self.levels = self.levels[1:] + [guesses]


@dataclass(frozen=True)
class LookaheadDecodingOptions(MethodOptions):
    window_size: int = 3  # W: Jacobi columns
    ngram_size: int = 3  # N: the window has N - 1 levels
    guess_set_size: int = 2  # pooled n-grams verified per step
    max_nodes: int | str | None = "auto"  # a cap on the tree; "auto": sized each step by the measured costs


def _make(build: BuildContext, options: LookaheadDecodingOptions):
    window_nodes = options.window_size * (options.ngram_size - 1)  # verified every step, drafted to be guesses
    return sized_by_costs(lambda nodes: LookaheadDecodingDrafter(**{**options.as_dict(), "max_nodes": nodes}),
                          options.max_nodes, build.target_model, fixed_nodes=window_nodes)


register(
    MethodSpec(
        name="lookahead-decoding",
        family="parallel",
        lossless="distribution-exact",
        paper="Fu et al. 2024, arXiv:2402.02057",
        summary="2-D Jacobi window (W columns, N-1 levels) feeds an n-gram pool; pooled n-grams are verified as a tree",
        drafter=Part(_make, LookaheadDecodingOptions),
    )
)
