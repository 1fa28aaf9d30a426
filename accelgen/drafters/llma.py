"""LLMA, inference with reference (Yang et al. 2023): copy spans from reference documents the output overlaps.

In retrieval-augmented generation the answer quotes the retrieved documents; in cache-assisted generation it
repeats an earlier answer; in multi-turn chat it reuses the previous turn. The user passes those documents as
`references`. When the last n tokens of the context (n from max_match down to min_match; the paper's trigger
is n = 1) occur in a reference, the next copy_length tokens of that reference are the draft. With
branches > 1, distinct spans from several matches are verified together as a token tree.

References are texts (tokenized with the target's tokenizer) or token-id lists. Drafts are deterministic, so the method is exact for sampling too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from accelgen.draft import Draft, Verdict
from accelgen.drafters.base import BuildContext, Drafter
from accelgen.drafters.candidate_tree import draft_from_candidates
from accelgen.drafters.prompt_lookup import NGramIndex, check_at_least_one, check_size_range
from accelgen.errors import InputError
from accelgen.registry import MethodOptions, MethodSpec, Part, register

DOCUMENT_BREAK = -1  # between references in the index: no n-gram of real tokens matches across it
MAX_OCCURRENCES_PER_NGRAM = 16  # matches examined per n-gram size: bounds the work per step


def reference_token_ids(references, tokenizer=None) -> list[list[int]]:
    """references as token-id lists; text is tokenized when a tokenizer is given."""
    if isinstance(references, (str, bytes)) or not isinstance(references, (list, tuple)):
        raise TypeError("references must be a list of documents (token-id lists, or strings with a tokenizer)")
    documents = []
    for reference in references:
        if isinstance(reference, str):
            if tokenizer is None:
                raise InputError(
                    "text references need the tokenizer, which this drafter was not given; "
                    "pass token ids instead: references=[tokenizer(text, add_special_tokens=False).input_ids, ...]"
                )
            documents.append(list(tokenizer(reference, add_special_tokens=False).input_ids))
        elif isinstance(reference, torch.Tensor):
            documents.append(reference.reshape(-1).tolist())
        elif isinstance(reference, (list, tuple)) and all(isinstance(t, int) and t >= 0 for t in reference):
            documents.append(list(reference))
        else:
            raise TypeError("each reference must be a string or a list of non-negative token ids")
    return documents


def index_references(documents: list[list[int]], max_match: int) -> NGramIndex:
    """One n-gram index over all documents, separated by DOCUMENT_BREAK."""
    index = NGramIndex(1, max_match)
    for document in documents:
        index.extend(document + [DOCUMENT_BREAK])
    return index


def span_after(tokens: list[int], start: int, length: int) -> list[int]:
    """Up to `length` tokens from `start`, stopping at the end of the document."""
    span = []
    for token in tokens[start : start + length]:
        if token == DOCUMENT_BREAK:
            break
        span.append(token)
    return span


class ReferenceDrafter(Drafter):
    def __init__(self, references: list[list[int]], min_match: int = 1, max_match: int = 4, copy_length: int = 16,
                 branches: int = 1):
        check_size_range(("min_match", min_match), ("max_match", max_match))
        check_at_least_one(copy_length=copy_length, branches=branches)
        self.min_match, self.max_match = min_match, max_match
        self.copy_length = copy_length
        self.branches = branches
        self.index = index_references(references, max_match)

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        """context: (L,) long; only its last max_match tokens are read."""
        tail = context[-self.max_match :].tolist()
        length = min(self.copy_length, max_nodes)
        return draft_from_candidates(self._spans(tail, length), max_nodes)

    def _spans(self, tail: list[int], length: int) -> list[list[int]]:
        """Distinct reference spans following the tail: longest match first, then document order."""
        spans: list[list[int]] = []
        for n in range(min(self.max_match, len(tail)), self.min_match - 1, -1):
            for end in self.index.occurrences(tuple(tail[-n:]))[:MAX_OCCURRENCES_PER_NGRAM]:
                span = span_after(self.index.tokens, end, length)
                if span and span not in spans:
                    spans.append(span)
                    if len(spans) == self.branches:
                        return spans
        return spans

    def update(self, draft: Draft, verdict: Verdict, target_logits: torch.Tensor) -> None:
        pass


@dataclass(frozen=True)
class ReferenceOptions(MethodOptions):
    references: list = field(default_factory=list)  # documents: texts, or token-id lists
    min_match: int = 1  # the shortest context suffix matched in them ...
    max_match: int = 4  # ... and the longest
    copy_length: int = 16  # tokens copied after a match
    branches: int = 1  # matches drafted together, as a tree


def _make(build: BuildContext, options: ReferenceOptions) -> ReferenceDrafter:
    references = reference_token_ids(options.references, build.tokenizer)
    return ReferenceDrafter(**{**options.as_dict(), "references": references})


register(
    MethodSpec(
        name="llma",
        family="speculative",
        lossless="distribution-exact",
        paper="Yang et al. 2023, arXiv:2304.04487",
        summary="copies spans of user-supplied reference documents (RAG, cached answers) that the output overlaps",
        drafter=Part(_make, ReferenceOptions),
        needs=("references",),
    )
)
