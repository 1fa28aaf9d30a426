"""How close a lossy method's output stays to greedy decoding: small pure functions over token id lists."""

from __future__ import annotations

import functools


def token_agreement(reference: list[int], output: list[int]) -> float:
    """Fraction of positions holding the same token in both, over the longer of the two (a missing token
    counts as a disagreement); 1.0 when both are empty.

    Example: reference [1, 2, 3, 4], output [1, 2, 9]  ->  2 / 4 = 0.5
    """
    longest = max(len(reference), len(output))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(reference, output)) / longest


def matching_prefix(reference: list[int], output: list[int]) -> int:
    """Number of leading tokens the two share: where the output first departs from the reference."""
    shared = 0
    for a, b in zip(reference, output):
        if a != b:
            break
        shared += 1
    return shared


def rouge_l(reference: list[int], output: list[int]) -> float:
    """ROUGE-L F1 over tokens: the longest common subsequence, as a share of each sequence, harmonically
    averaged; 1.0 when both are empty. Unlike token agreement, a shifted but otherwise equal text still scores high.

    Computed by Google's `rouge-score` (the bench extra) over the token ids themselves, not over text: its
    default tokenizer would lowercase and re-split the decoded text, so two outputs differing in one token could
    score as equal. The ids are joined by spaces and split back by a whitespace tokenizer.

    Example: reference [1, 2, 3, 4], output [9, 1, 2, 3]  ->  LCS 3, precision 3/4, recall 3/4  ->  0.75
    """
    if not reference and not output:
        return 1.0  # rouge-score gives 0 for two empty texts; two empty outputs are the same output
    scores = _token_id_scorer().score(" ".join(map(str, reference)), " ".join(map(str, output)))
    return scores["rougeL"].fmeasure


@functools.cache
def _token_id_scorer():
    """A ROUGE-L scorer over space-separated token ids (rouge_score is imported here: the bench extra)."""
    from rouge_score import rouge_scorer, tokenizers

    class TokenIdTokenizer(tokenizers.Tokenizer):
        def tokenize(self, text: str) -> list[str]:
            return text.split()

    return rouge_scorer.RougeScorer(["rougeL"], tokenizer=TokenIdTokenizer())
