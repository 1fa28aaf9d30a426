"""Measured costs, and the draft budget that keeps speculation from ever losing to plain decoding.

A draft of γ tokens pays only if the tokens it is expected to add outweigh what it costs: drafting (γ·c, c =
one draft step over one target step) plus verifying γ + 1 tokens instead of 1 (r(γ+1) = t(γ+1) / t(1)). r(k)
decides everything and differs by machine: ≈1.15 at k = 8 where the CPU multiplies bf16 natively, ≈6–7 on an
AVX2-only CPU, in PyTorch and in llama.cpp alike. So r(k) is measured once per model, weight format and machine
and cached; `DraftBudget` caps each step's draft at the length with the best predicted speedup from it, the
running acceptance α and the measured c, and at 0 — plain decoding — when no length pays.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from accelgen import hardware
from accelgen.theory import AcceptanceEstimate, predicted_speedup

SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
CONTEXT_TOKENS = 128
REPEATS = 3
PROBE_EVERY = 8  # with no draft paying, one step in this many drafts a single token, so α keeps being measured
MIN_GAIN = 1.02  # a draft must be predicted this much faster than plain decoding (timings are noisy)


def model_format(model) -> str:
    from accelgen.models.formats import weight_format
    from accelgen.models.llamacpp import LlamaCppModel

    return "gguf" if isinstance(model, LlamaCppModel) else weight_format(model)


def model_key(model) -> str:
    """Which model the costs belong to: its name or folder, else its shape (tiny test models)."""
    config = model.config
    name = Path(str(getattr(model, "name_or_path", "") or getattr(config, "_name_or_path", "") or "")).name
    shape = [getattr(config, key, None) for key in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")]
    return f"{name or getattr(config, 'model_type', 'model')}-{'x'.join(str(value) for value in shape)}"


def costs_path(model, threads: int | None = None) -> Path:
    from accelgen.models.loading import cache_dir

    return cache_dir() / "costs" / hardware.machine_key(threads) / f"{model_key(model)}-{model_format(model)}.json"


def measure_verify_ratios(model, sizes=SIZES) -> dict[int, float]:
    """r(k) = t(k) / t(1): one forward over k tokens after CONTEXT_TOKENS cached, over one over 1 token."""
    from accelgen.profile import batch_forward_seconds, timing_prompt

    seconds = batch_forward_seconds(model, timing_prompt(model, CONTEXT_TOKENS), 1, sorted(set(sizes) | {1}), REPEATS)
    return {k: t / seconds[1] for k, t in seconds.items()}


def verify_ratios(model, threads: int | None = None, remeasure: bool = False,
                  measure: Callable[[object], dict[int, float]] = measure_verify_ratios) -> dict[int, float]:
    """The model's r(k), measured once per model, weight format and machine, then read from the cache."""
    path = costs_path(model, threads)
    if path.is_file() and not remeasure:
        return {int(k): v for k, v in json.loads(path.read_text())["verify_ratio"].items()}
    print(f"accelgen: measuring verification costs of {model_key(model)} ({model_format(model)}) once on this machine",
          file=sys.stderr)
    ratios = measure(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"verify_ratio": ratios, "machine": hardware.describe(threads),
                                   "format": model_format(model)}, indent=1) + "\n")
    partial.replace(path)
    return ratios


def best_draft_length(alpha: float, cost_ratio: float, max_length: int, verify_ratio: Callable[[int], float]) -> int:
    """The γ in 0..max_length with the best predicted speedup E(α, γ) / (γc + r(γ+1)); 0 (plain decoding, speedup
    1) unless some γ is predicted at least MIN_GAIN faster."""
    best, best_speedup = 0, MIN_GAIN
    for gamma in range(1, max_length + 1):
        speedup = predicted_speedup(alpha, gamma, cost_ratio, verify_ratio(gamma + 1))
        if speedup > best_speedup:
            best, best_speedup = gamma, speedup
    return best


class DraftBudget:
    """Caps each step's draft by measured costs (the loop asks `limit()` before drafting, `observe()` after).

    α: from the steps' accepted tokens (AcceptanceEstimate, starting at `prior_alpha`); c: the drafting time per
    drafted token over the target step's time, both timed by the loop; r(k): measured once (verify_ratios)."""

    def __init__(self, verify_ratio: dict[int, float], prior_alpha: float = 0.5, max_length: int = 16):
        from accelgen.profile import interpolate

        self.verify_ratio = lambda tokens: interpolate(verify_ratio, tokens)
        self.max_length = max_length
        self.acceptance = AcceptanceEstimate()
        # the prior as pseudo-observations: accepted / (accepted + rejections) ≈ prior_alpha
        self.acceptance.accepted, self.acceptance.rejections = 2 * prior_alpha, 2 * (1 - prior_alpha)
        self.cost_ratio = 0.0  # drafting time per drafted token / target step time (model-free drafters: ≈ 0)
        self.steps_without_draft = 0
        self.last_limit = max_length

    def limit(self) -> int:
        gamma = best_draft_length(self.acceptance.alpha, self.cost_ratio, self.max_length, self.verify_ratio)
        if gamma == 0:
            self.steps_without_draft += 1
            if self.steps_without_draft % PROBE_EVERY == 0:
                gamma = 1  # keep measuring α: the text may become easy to draft
        self.last_limit = gamma
        return gamma

    def observe(self, drafted: int, accepted: int, draft_seconds: float, forward_seconds: float) -> None:
        """One step: `drafted` tokens proposed in draft_seconds, `accepted` of them, verified by a target forward
        of forward_seconds (over drafted + 1 tokens, so one decoding step costs forward_seconds / r(drafted + 1))."""
        if self.last_limit == 0:
            return  # a plain decoding step: nothing learned about drafts
        self.acceptance.observe(drafted, accepted)
        if drafted and forward_seconds > 0:
            ratio = (draft_seconds / drafted) / (forward_seconds / self.verify_ratio(drafted + 1))
            self.cost_ratio = ratio if self.cost_ratio == 0 else 0.8 * self.cost_ratio + 0.2 * ratio

