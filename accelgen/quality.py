"""How close a lossy method's output stays to greedy decoding: small pure functions over token id lists."""

from __future__ import annotations


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

    Example: reference [1, 2, 3, 4], output [9, 1, 2, 3]  ->  LCS 3, precision 3/4, recall 3/4  ->  0.75
    """
    if not reference and not output:
        return 1.0
    previous = [0] * (len(output) + 1)  # LCS lengths of the reference so far against each prefix of the output
    for token in reference:
        current = [0]
        for j, other in enumerate(output):
            current.append(previous[j] + 1 if token == other else max(previous[j + 1], current[j]))
        previous = current
    common = previous[-1]
    if common == 0:
        return 0.0
    precision, recall = common / len(output), common / len(reference)
    return 2 * precision * recall / (precision + recall)
