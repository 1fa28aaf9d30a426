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
