"""Measured forward costs, the inputs of the analytical model (accelgen/theory.py).

Decoding Speculative Decoding (Yan et al. 2024) predicts a drafter's speedup from three numbers: the
acceptance α, the draft's cost c (one draft forward over one target forward) and the verification cost
r(k) (one target forward over k tokens over a forward over one token). On a CPU at batch size 1 a forward
is bound by reading the weights, so r(k) stays near 1 for small k; `accelgen profile` measures how far.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from accelgen.models.runner import ModelRunner
from accelgen.theory import best_gamma, predicted_speedup

SIZES = (1, 2, 4, 8, 16, 32)


def forward_seconds(model, prompt_ids: list[int], new_tokens: int = 1, repeats: int = 5) -> float:
    """Median time of one forward over `new_tokens` tokens after a KV cache of prompt_ids (the first is warm-up)."""
    runner = ModelRunner(model)
    runner.forward(torch.tensor(prompt_ids), logits_for_last=1)
    prefix = runner.length
    block = torch.tensor((prompt_ids * new_tokens)[:new_tokens])  # token values do not change the cost
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        runner.forward(block)  # every row's logits, as verification needs them
        times.append(time.perf_counter() - started)
        runner.keep(prefix, [])  # forget the block again
    return statistics.median(times[1:])


def profile(model, draft_model=None, *, context_tokens: int = 256, sizes=SIZES, repeats: int = 5,
            progress: Callable[[str], None] = lambda message: None) -> dict:
    """Target forward time per block size k and r(k) = t(k) / t(1); with a draft model, its time and c."""
    prompt_ids = [(7 * i) % model.config.vocab_size for i in range(1, context_tokens + 1)]
    target_seconds = {}
    for k in sorted(set(sizes) | {1}):
        progress(f"target forward over {k} token(s)")
        target_seconds[k] = forward_seconds(model, prompt_ids, k, repeats)
    result = {"context_tokens": context_tokens, "target_seconds": target_seconds,
              "verify_ratio": {k: seconds / target_seconds[1] for k, seconds in target_seconds.items()}}
    if draft_model is not None:
        progress("draft forward over 1 token")
        result["draft_seconds"] = forward_seconds(draft_model, prompt_ids, 1, repeats)
        result["cost_ratio"] = result["draft_seconds"] / target_seconds[1]
    return result


def verify_ratio(measured: dict[int, float], k: int) -> float:
    """r(k) from the measured sizes, linear between them (beyond the largest: its slope continued)."""
    sizes = sorted(measured)
    if k in measured:
        return measured[k]
    below = max((size for size in sizes if size < k), default=sizes[0])
    above = min((size for size in sizes if size > k), default=None)
    if above is None:  # extrapolate from the last two sizes
        below, above = sizes[-2] if len(sizes) > 1 else sizes[-1], sizes[-1]
    if above == below:
        return measured[below]
    slope = (measured[above] - measured[below]) / (above - below)
    return measured[below] + slope * (k - below)


def speedup_table(result: dict, alphas, max_gamma: int = 16) -> list[dict]:
    """Per α: the γ with the best predicted speedup E / (γc + r(γ+1)), and that speedup."""
    cost, ratio = result["cost_ratio"], lambda tokens: verify_ratio(result["verify_ratio"], tokens)
    rows = []
    for alpha in alphas:
        best = best_gamma(alpha, cost, max_gamma, ratio)
        speedup = predicted_speedup(alpha, best, cost, ratio(best + 1))
        rows.append({"alpha": alpha, "best_gamma": best, "predicted_speedup": speedup})
    return rows
