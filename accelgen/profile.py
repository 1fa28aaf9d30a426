"""Measured forward costs, the inputs of the analytical model (accelgen/theory.py).

Decoding Speculative Decoding (Yan et al. 2024) predicts a drafter's speedup from three numbers: the
acceptance α, the draft's cost c (one draft forward over one target forward) and the verification cost
r(k) (one target forward over k tokens over a forward over one token). Where a forward is bound by reading
the weights, r(k) stays near 1 for small k (r(8) ≈ 1.15 on a CPU with native bf16 matrix instructions); where
it is bound by arithmetic it grows almost as k (r(8) ≈ 6 on an AVX2-only CPU). `accelgen profile` measures
how far; accelgen/costs.py measures the costs the policies use once per machine and caches them.
"""

from __future__ import annotations

from typing import Callable

from accelgen.models.timing import batch_forward_seconds, forward_seconds, timing_prompt
from accelgen.theory import best_gamma, predicted_speedup

SIZES = (1, 2, 4, 8, 16, 32)


def profile(model, draft_model=None, *, context_tokens: int = 256, sizes=SIZES, repeats: int = 5, batch_sizes=(),
            progress: Callable[[str], None] = lambda message: None) -> dict:
    """Target forward time per block size k and r(k) = t(k) / t(1); with a draft model, its time and c;
    with batch_sizes, t(b, k) for b sequences of k tokens each (the server's batched verification)."""
    prompt_ids = timing_prompt(model, context_tokens)
    block_sizes = sorted(set(sizes) | {1})
    progress("target forwards")
    target_seconds = batch_forward_seconds(model, prompt_ids, 1, block_sizes, repeats)
    result = {"context_tokens": context_tokens, "target_seconds": target_seconds,
              "verify_ratio": {k: seconds / target_seconds[1] for k, seconds in target_seconds.items()}}
    if batch_sizes:
        result["batch_seconds"] = {}
        for batch in sorted(set(batch_sizes)):
            progress(f"batches of {batch} sequences")
            result["batch_seconds"][batch] = batch_forward_seconds(model, prompt_ids, batch, block_sizes, repeats)
    if draft_model is not None:
        progress("draft forward over 1 token")
        result["draft_seconds"] = forward_seconds(draft_model, prompt_ids, 1, repeats)
        result["cost_ratio"] = result["draft_seconds"] / target_seconds[1]
    return result


def interpolate(measured: dict[int, float], x: int) -> float:
    """A measured quantity at x (e.g. r(k) at k tokens) from its measured points, linear between them (beyond
    the largest: the last slope continued; below the smallest: that point's value)."""
    sizes = sorted(measured)
    if x in measured:
        return measured[x]
    below = max((size for size in sizes if size < x), default=sizes[0])
    above = min((size for size in sizes if size > x), default=None)
    if above is None:  # extrapolate from the last two sizes
        below, above = sizes[-2] if len(sizes) > 1 else sizes[-1], sizes[-1]
    if above == below:
        return measured[below]
    slope = (measured[above] - measured[below]) / (above - below)
    return measured[below] + slope * (x - below)


def batch_table(result: dict, alpha: float, max_gamma: int = 16) -> list[dict]:
    """Per batch size b, for a model-free drafter of acceptance α: the γ with the best predicted throughput
    gain E(α, γ) · t(b, 1) / t(b, γ+1), that gain, and the token budget b · (γ + 1) it implies (the server
    caps drafts at budget // b − 1)."""
    rows = []
    for batch, seconds in result["batch_seconds"].items():
        ratio = {k: t / seconds[1] for k, t in seconds.items()}
        best = best_gamma(alpha, 0.0, max_gamma, lambda tokens: interpolate(ratio, tokens))  # 0: do not speculate
        gain = predicted_speedup(alpha, best, 0.0, interpolate(ratio, best + 1))
        rows.append({"batch": batch, "best_gamma": best, "predicted_gain": gain, "token_budget": batch * (best + 1)})
    return rows


def speedup_table(result: dict, alphas, max_gamma: int = 16) -> list[dict]:
    """Per α: the γ with the best predicted speedup E / (γc + r(γ+1)) (0: plain decoding), and that speedup."""
    cost, ratio = result["cost_ratio"], lambda tokens: interpolate(result["verify_ratio"], tokens)
    rows = []
    for alpha in alphas:
        best = best_gamma(alpha, cost, max_gamma, ratio)
        speedup = predicted_speedup(alpha, best, cost, ratio(best + 1))
        rows.append({"alpha": alpha, "best_gamma": best, "predicted_speedup": speedup})
    return rows
