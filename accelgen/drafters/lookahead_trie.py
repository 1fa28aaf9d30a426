"""Lookahead (Zhao et al. 2023, Ant Group): multi-branch drafts retrieved from a global trie of token branches.

Every window of up to `depth` consecutive tokens of prompts and outputs is a path in one trie, each node
counting how many windows pass through it. A draft is the subtree below the context's last few tokens: the
heaviest branches under a node budget, verified together as a token tree. The trie is maintained by

    branch inserting     a request's prompt at its start (counted for that request only), then its output
                         as it is committed (counted for everyone), so repeats within a response are found
                         at once and later requests reuse earlier answers;
    branch eliminating   a request's prompt branches are removed when the request ends: they matter only to it;
    node pruning         when the trie exceeds `capacity` nodes, output counts are halved and nodes left
                         with no count are dropped, so old, rare branches fade first.

Retrieval is multi-stage: the longest prefix (max_prefix tokens) gives the most relevant branches; when they
hold fewer than branch_length tokens, shorter prefixes are tried for more. Prompt branches are prioritized by
weighting their counts with prompt_boost, as the paper amplifies their frequency.

Sharing: by default each generate call gets a fresh trie (prompt and own output only). To keep what earlier
requests taught it, create one `LookaheadTrie()` per model (tokenizer) and pass it as the `trie=` option to
every call; there is no hidden module-level trie. A trie is not thread-safe: share it between requests that
run one after another. A request's prompt branches are eliminated when its drafter is closed, which the
drafter does when it is garbage-collected at the end of generation (or call `drafter.close()`).
Drafts are deterministic, so the method is exact for sampling too.
"""

from __future__ import annotations

import heapq
import itertools
import weakref
from dataclasses import dataclass

import torch

from accelgen.draft import ROOT, Draft, Verdict
from accelgen.drafters.base import BuildContext, ContextCursor, Drafter
from accelgen.drafters.budget import sized_by_costs
from accelgen.drafters.prompt_lookup import check_at_least_one
from accelgen.errors import InputError
from accelgen.registry import MethodOptions, MethodSpec, Part, register


class TrieNode:
    __slots__ = ("children", "output_count", "prompt_counts")

    def __init__(self):
        self.children: dict[int, TrieNode] = {}
        self.output_count = 0  # windows of outputs through this node
        self.prompt_counts: dict[int, int] | None = None  # request -> windows of its live prompt through this node

    def total(self) -> int:
        return self.output_count + (sum(self.prompt_counts.values()) if self.prompt_counts else 0)

    def score(self, request: int | None, prompt_boost: float) -> float:
        prompt = self.prompt_counts.get(request, 0) if self.prompt_counts else 0
        return self.output_count + prompt_boost * prompt


class LookaheadTrie:
    """Token branches of up to `depth` tokens from prompts and outputs, at most about `capacity` nodes."""

    def __init__(self, depth: int = 12, capacity: int = 100_000):
        if depth < 2:
            raise InputError(f"depth must be >= 2, got {depth}")
        if capacity < 1:
            raise InputError(f"capacity must be >= 1, got {capacity}")
        self.depth = depth
        self.capacity = capacity
        self.root = TrieNode()
        self.size = 0  # nodes below the root
        self.vocab_size: int | None = None  # of the first model that used the trie: ids mean nothing elsewhere
        self._prompts: dict[int, list[int]] = {}  # live request -> its prompt
        self._request_ids = itertools.count()

    # --- branch inserting ---

    def open_request(self, prompt: list[int]) -> int:
        """Insert a request's prompt branches, counted for that request only; returns the request id."""
        request = next(self._request_ids)
        self._prompts[request] = list(prompt)
        self._insert(prompt, 0, request)
        self._prune_if_full()
        return request

    def insert_output(self, tokens: list[int], new: int) -> None:
        """Count the windows through the last `new` tokens of tokens; the tokens before them (up to depth - 1)
        are the committed context those windows start in."""
        self._insert(tokens, len(tokens) - new, None)
        self._prune_if_full()

    def _insert(self, tokens: list[int], start: int, request: int | None) -> None:
        """Walk every window that reaches tokens[start:], counting the nodes from position `start` on.

        Nodes before `start` were counted when they were new; one missing there (pruned) is re-created and
        counted once, for this window.
        """
        for first in range(max(0, start - self.depth + 1), len(tokens)):
            node = self.root
            for position in range(first, min(first + self.depth, len(tokens))):
                child = node.children.get(tokens[position])
                if child is None:
                    child = node.children[tokens[position]] = TrieNode()
                    self.size += 1
                    _count(child, request)
                elif position >= start:
                    _count(child, request)
                node = child

    # --- branch eliminating ---

    def eliminate(self, request: int) -> None:
        """Remove a request's prompt counts; branches nothing else passes through are dropped."""
        prompt = self._prompts.pop(request, None)
        if prompt is None:
            return
        for first in range(len(prompt)):
            node = self.root
            for token in prompt[first : first + self.depth]:
                child = node.children.get(token)
                if child is None:
                    break
                if child.prompt_counts:
                    child.prompt_counts.pop(request, None)
                    child.prompt_counts = child.prompt_counts or None
                if child.total() == 0:  # every node below counts no more than this one: drop them all
                    del node.children[token]
                    self.size -= _subtree_size(child)
                    break
                node = child

    # --- node pruning ---

    def prune(self) -> None:
        """Halve every output count and drop the nodes (with their subtrees) left with no count."""
        size, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            for token, child in list(node.children.items()):
                child.output_count //= 2
                if child.total() == 0:
                    del node.children[token]
                else:
                    size += 1
                    stack.append(child)
        self.size = size

    def _prune_if_full(self) -> None:
        while self.size > self.capacity:
            before = self.size
            self.prune()
            if self.size == before:  # only live prompts left: they stay until their requests end
                return

    # --- retrieval ---

    def node_at(self, prefix: list[int], request: int | None = None) -> TrieNode | None:
        """The node reached by prefix from the root, if every step has a count visible to request."""
        node = self.root
        for token in prefix:
            node = node.children.get(token)
            if node is None or node.score(request, 1.0) <= 0:
                return None
        return node

    def retrieve(self, tail: list[int], request: int | None, *, max_nodes: int, branch_length: int,
                 max_prefix: int, prompt_boost: float) -> Draft:
        """Multi-stage retrieval: branches below the longest matching suffix of tail (up to max_prefix tokens)
        that yields at least min(branch_length, max_nodes) nodes, else the largest draft any prefix gave."""
        best = Draft.empty()
        for length in range(min(max_prefix, len(tail), self.depth - 1), 0, -1):
            node = self.node_at(tail[-length:], request)
            if node is None:
                continue
            draft = best_branches(node, request, max_nodes, min(branch_length, self.depth - length), prompt_boost)
            if len(draft) > len(best):
                best = draft
            if len(best) >= min(branch_length, max_nodes):
                break
        return best


def _count(node: TrieNode, request: int | None) -> None:
    if request is None:
        node.output_count += 1
    else:
        node.prompt_counts = node.prompt_counts or {}
        node.prompt_counts[request] = node.prompt_counts.get(request, 0) + 1


def _subtree_size(node: TrieNode) -> int:
    size, stack = 0, [node]
    while stack:
        current = stack.pop()
        size += 1
        stack.extend(current.children.values())
    return size


def best_branches(start: TrieNode, request: int | None, max_nodes: int, max_depth: int, prompt_boost: float) -> Draft:
    """The heaviest nodes below start as a Draft, expanded best-first: a node is taken only after its parent,
    so the result is a tree; siblings come heaviest first. Nodes scoring 0 for request are skipped."""
    tokens: list[int] = []
    parents: list[int] = []
    frontier: list = []  # heap of (-score, depth, tie-breaker, token, node, parent draft index)
    tie = itertools.count()

    def push_children(node: TrieNode, parent: int, depth: int) -> None:
        if depth > max_depth:
            return
        scored = ((child.score(request, prompt_boost), token, child) for token, child in node.children.items())
        for score, token, child in heapq.nlargest(max_nodes, scored, key=lambda item: item[0]):
            if score > 0:
                heapq.heappush(frontier, (-score, depth, next(tie), token, child, parent))

    push_children(start, ROOT, 1)
    while frontier and len(tokens) < max_nodes:
        _, depth, _, token, node, parent = heapq.heappop(frontier)
        tokens.append(token)
        parents.append(parent)
        push_children(node, len(tokens) - 1, depth + 1)
    return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


class TrieLookaheadDrafter(Drafter):
    def __init__(self, trie: LookaheadTrie | None, vocab_size: int, max_nodes: int = 8, branch_length: int = 8,
                 max_prefix: int = 4, prompt_boost: float = 1e4):
        check_at_least_one(max_nodes=max_nodes, branch_length=branch_length, max_prefix=max_prefix)
        if prompt_boost < 0:
            raise InputError(f"prompt_boost must be >= 0, got {prompt_boost}")
        if trie is not None and not isinstance(trie, LookaheadTrie):
            raise TypeError(f"trie must be a LookaheadTrie, not {type(trie).__name__}")
        self.trie = trie if trie is not None else LookaheadTrie(depth=max_prefix + branch_length)
        if self.trie.vocab_size is None:
            self.trie.vocab_size = vocab_size
        elif self.trie.vocab_size != vocab_size:
            raise InputError(f"this LookaheadTrie holds tokens of a {self.trie.vocab_size}-token vocabulary; "
                             f"the target has {vocab_size}: use one trie per tokenizer")
        self.max_nodes, self.branch_length = max_nodes, branch_length
        self.max_prefix, self.prompt_boost = max_prefix, prompt_boost
        self.request: int | None = None
        self.tail: list[int] = []  # the last committed tokens, enough to start every window and prefix
        self.read = ContextCursor()  # context tokens already inserted
        self._close = None

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        """context: (L,) long; the whole prompt is read once, then only the tokens committed since."""
        keep = max(self.trie.depth - 1, self.max_prefix)
        new = self.read.new_since_last(context)
        if self.request is None:
            prompt = new
            self.request = self.trie.open_request(prompt)
            self._close = weakref.finalize(self, self.trie.eliminate, self.request)
            self.tail = prompt[-keep:]
        else:
            self.trie.insert_output(self.tail + new, len(new))
            self.tail = (self.tail + new)[-keep:]
        return self.trie.retrieve(self.tail, self.request, max_nodes=min(self.max_nodes, max_nodes),
                                  branch_length=self.branch_length, max_prefix=self.max_prefix,
                                  prompt_boost=self.prompt_boost)

    def update(self, draft: Draft, verdict: Verdict, target_logits: torch.Tensor) -> None:
        pass  # committed tokens are inserted with the next context

    def close(self) -> None:
        """End the request: eliminate its prompt branches (idempotent). Its output branches stay."""
        if self._close is not None:
            self._close()


@dataclass(frozen=True)
class TrieLookaheadOptions(MethodOptions):
    trie: object = None  # a LookaheadTrie shared across requests (None: one of its own)
    max_nodes: int | str = "auto"  # tree nodes per draft; "auto": sized each step by the measured costs
    branch_length: int = 8  # the longest branch
    max_prefix: int = 4  # the longest context suffix looked up
    prompt_boost: float = 1e4  # weight of the prompt's own n-grams over other requests'


def _make(build: BuildContext, options: TrieLookaheadOptions):
    vocab_size = build.target_model.config.vocab_size
    settings = {name: value for name, value in options.as_dict().items() if name not in ("trie", "max_nodes")}
    return sized_by_costs(lambda nodes: TrieLookaheadDrafter(options.trie, vocab_size, **settings, max_nodes=nodes),
                          options.max_nodes, build.target_model)


register(
    MethodSpec(
        name="trie-lookahead",
        family="speculative",
        lossless="distribution-exact",
        paper="Zhao et al. 2023, arXiv:2312.12728",
        summary="multi-branch drafts from a trie of prompt and output n-grams, shared across requests via trie=",
        drafter=Part(_make, TrieLookaheadOptions),
    )
)
