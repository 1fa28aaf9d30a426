"""Prompt lookup decoding (Saxena 2023): copy what followed the last earlier occurrence of the context's tail.

Generated text often repeats its prompt or itself (code edits, summaries, quotes, lists). The drafter looks
for the last n tokens of the context (n from max_ngram down to min_ngram) earlier in prompt + generated text
and proposes the draft_length tokens that followed the most recent earlier occurrence. With branches > 1 it
proposes several different continuations (older occurrences, then shorter n-grams) as one token tree.

An n-gram index, updated with only the new tokens of each step, keeps a proposal O(draft_length · branches)
instead of a rescan of the whole context. Drafts are deterministic, so speculative sampling verifies them as
point masses: the method is exact for sampling too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelgen.draft import Draft, Verdict
from accelgen.drafters.base import BuildContext, Drafter
from accelgen.drafters.budget import sized_by_costs
from accelgen.drafters.candidate_tree import draft_from_candidates
from accelgen.errors import InputError
from accelgen.registry import MethodOptions, MethodSpec, Part, register

MAX_OCCURRENCES_PER_NGRAM = 4  # occurrences examined per branch and n-gram size: bounds the work per step


class NGramIndex:
    """End positions of every n-gram (min_n <= n <= max_n) of a growing token sequence.

    ends[(t1, ..., tn)] lists, in increasing order, each position e with tokens[e-n:e] == (t1, ..., tn), i.e.
    where its continuation starts. Example, tokens [7, 8, 7, 8], n = 2: ends[(7, 8)] = [2, 4], ends[(8, 7)] = [3].
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, new_tokens: list[int]) -> None:
        for token in new_tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends.setdefault(tuple(self.tokens[end - n : end]), []).append(end)

    def follow(self, context: torch.Tensor) -> None:
        """Index the tokens of context (L,) beyond those indexed; start over when context is another sequence.
        Only the new tokens leave the tensor, so a step costs the same on a long context as on a short one."""
        if len(context) < len(self.tokens):
            self.tokens, self.ends = [], {}
        self.extend(context[len(self.tokens) :].tolist())

    def occurrences(self, ngram: tuple[int, ...]) -> list[int]:
        """End positions of ngram, oldest first (empty when absent)."""
        return self.ends.get(ngram, [])


def copy_continuation(tokens: list[int], start: int, length: int) -> list[int]:
    """tokens[start:start+length], continued periodically past the end of tokens.

    A match ending at `start` says the text from `start` on repeats at the end, so token len(tokens) + i is
    copied from start + i, which may itself be a token just copied. Example: tokens [a b a b], start 2,
    length 4 -> [a b a b].
    """
    copied: list[int] = []
    for position in range(start, start + length):
        copied.append(tokens[position] if position < len(tokens) else copied[position - len(tokens)])
    return copied


def lookup_candidates(index: NGramIndex, length: int, branches: int) -> list[list[int]]:
    """Up to `branches` distinct continuations of the index's own tail: longest n-gram first, most recent first."""
    tokens, candidates = index.tokens, []
    for n in range(min(index.max_n, len(tokens)), index.min_n - 1, -1):
        examined = 0
        for end in reversed(index.occurrences(tuple(tokens[-n:]))):
            if end == len(tokens):  # the tail itself
                continue
            continuation = copy_continuation(tokens, end, length)
            if continuation not in candidates:
                candidates.append(continuation)
                if len(candidates) == branches:
                    return candidates
            examined += 1
            if examined == MAX_OCCURRENCES_PER_NGRAM * branches:
                break
    return candidates


def check_size_range(shortest: tuple[str, int], longest: tuple[str, int]) -> None:
    """A ValueError unless 1 <= shortest <= longest, the n-gram sizes looked up, each given as (name, size)."""
    (shortest_name, shortest_size), (longest_name, longest_size) = shortest, longest
    if not 1 <= shortest_size <= longest_size:
        raise InputError(f"need 1 <= {shortest_name} <= {longest_name}, got {shortest_name}={shortest_size}, "
                         f"{longest_name}={longest_size}")


def check_at_least_one(**counts: int) -> None:
    """A ValueError naming the first of counts (name=count) below 1."""
    for name, count in counts.items():
        if count < 1:
            raise InputError(f"{name} must be >= 1, got {count}")


class PromptLookupDrafter(Drafter):
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, draft_length: int = 10, branches: int = 1):
        check_size_range(("min_ngram", min_ngram), ("max_ngram", max_ngram))
        check_at_least_one(draft_length=draft_length, branches=branches)
        self.draft_length = draft_length
        self.branches = branches
        self.index = NGramIndex(min_ngram, max_ngram)

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        """context: (L,) long, prompt + committed tokens; only the tokens new since the last call are indexed."""
        self.index.follow(context)
        length = min(self.draft_length, max_nodes)
        return draft_from_candidates(lookup_candidates(self.index, length, self.branches), max_nodes)

    def update(self, draft: Draft, verdict: Verdict, target_logits: torch.Tensor) -> None:
        pass  # committed tokens reach the index through the next context


@dataclass(frozen=True)
class PromptLookupOptions(MethodOptions):
    max_ngram: int = 3  # the longest context suffix looked up ...
    min_ngram: int = 1  # ... and the shortest
    draft_length: int | str = "auto"  # tokens copied; "auto": sized each step by the measured costs
    branches: int = 1  # continuations drafted together, as a tree


def _make(build: BuildContext, options: PromptLookupOptions):
    return sized_by_costs(lambda length: PromptLookupDrafter(**{**options.as_dict(), "draft_length": length}),
                          options.draft_length, build.target_model)


register(
    MethodSpec(
        name="pld",
        family="speculative",
        lossless="distribution-exact",
        paper="Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding",
        summary="copies the tokens that followed the last earlier occurrence of the context's final n-gram",
        drafter=Part(_make, PromptLookupOptions),
    )
)
