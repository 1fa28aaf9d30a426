"""Divergence audit: when a greedy method's tokens differ from the baseline's, was it a numerical near-tie or an error?

At the first differing position the baseline's logits are recomputed by one plain forward without a cache over
prompt + the baseline's tokens before that position. If both the baseline's token and the method's token are
within a few units in the last place (ulps) of the best logit there, the two runs merely rounded a near-tie
differently: a (k+1)-token verification forward, a split prefill or a different kernel order sums in another
order. Otherwise the method picked a token the model clearly did not prefer: an error.

What counts as a near-tie (TIE_ULPS ulps of the best logit in the model's dtype; never in float32) is defined
once, in accelgen/bench/near_tie.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from accelgen.bench.near_tie import LLAMACPP_TIE, is_near_tie, tie_gap, tie_tolerance
from accelgen.models.llamacpp import LlamaCppModel


@dataclass(frozen=True)
class Divergence:
    position: int  # index into the new tokens of the first difference
    baseline_token: int | None  # None when the baseline ended before this position
    method_token: int | None
    top1_token: int | None = None
    top2_token: int | None = None
    top1_logit: float | None = None
    top2_logit: float | None = None
    baseline_token_logit: float | None = None
    method_token_logit: float | None = None
    tolerance: float | None = None
    classification: str = "error"  # "near-tie" or "error"
    reason: str = ""

    @property
    def margin(self) -> float | None:
        """Top-1 minus top-2 logit of the reference forward."""
        return None if self.top1_logit is None else self.top1_logit - self.top2_logit

    def to_dict(self) -> dict:
        return {**asdict(self), "margin": self.margin}


def first_difference(baseline: list[int], other: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter end); None if equal."""
    for position, (a, b) in enumerate(zip(baseline, other)):
        if a != b:
            return position
    return None if len(baseline) == len(other) else min(len(baseline), len(other))


def classify(reference_logits: torch.Tensor, position: int, baseline_token: int, method_token: int,
             dtype: torch.dtype | None, tolerance: float | None = None) -> Divergence:
    """Judge one divergence from the reference logits (vocab,) at the first differing position (tolerance: given,
    for an engine whose rounding is not a dtype's, else from dtype)."""
    top = torch.topk(reference_logits.float(), 2)
    top1, top2 = float(top.values[0]), float(top.values[1])
    baseline_logit = float(reference_logits[baseline_token])
    method_logit = float(reference_logits[method_token])
    tolerance = tolerance if tolerance is not None else tie_tolerance(dtype, top1)
    gap = tie_gap(reference_logits, baseline_token, method_token)  # how far the worse of the two is below the best
    if tolerance is None:
        classification, reason = "error", f"{dtype_name(dtype)} run: any divergence is an error"
    elif is_near_tie(reference_logits, baseline_token, method_token, dtype, tolerance):
        classification, reason = "near-tie", f"both tokens within {gap:.4g} of the best logit (tolerance {tolerance:.4g})"
    else:
        classification, reason = "error", f"a token is {gap:.4g} below the best logit (tolerance {tolerance:.4g})"
    return Divergence(position, baseline_token, method_token, int(top.indices[0]), int(top.indices[1]), top1, top2,
                      baseline_logit, method_logit, tolerance, classification, reason)


@torch.inference_mode()
def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    """(vocab,) float32 next-token logits after token_ids, from one forward without a KV cache."""
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
    output = model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    return output.logits[0, -1].float().cpu()


def audit(model, prompt_ids: list[int], baseline_tokens: list[int], method_tokens: list[int]) -> Divergence | None:
    """The first divergence of method_tokens from baseline_tokens, classified; None if they are identical."""
    position = first_difference(baseline_tokens, method_tokens)
    if position is None:
        return None
    if position >= len(baseline_tokens) or position >= len(method_tokens):
        ended = "baseline" if position >= len(baseline_tokens) else "method"
        return Divergence(position, at(baseline_tokens, position), at(method_tokens, position),
                          reason=f"the {ended} stopped earlier with the same tokens before it")
    if isinstance(model, LlamaCppModel):  # llama.cpp rounds by batch layout, not by a dtype: docs/llamacpp-engine.md
        logits = model.new_runner().forward(torch.tensor(prompt_ids + baseline_tokens[:position]), logits_for_last=1)[0]
        return classify(logits, position, baseline_tokens[position], method_tokens[position], None, LLAMACPP_TIE)
    logits = reference_logits(model, prompt_ids + baseline_tokens[:position])
    return classify(logits, position, baseline_tokens[position], method_tokens[position], model.dtype)


def at(tokens: list[int], position: int) -> int | None:
    return tokens[position] if position < len(tokens) else None


def dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_label(model) -> str:
    """What decides the model's rounding: its dtype, or the llama.cpp engine."""
    return "gguf (llama.cpp)" if isinstance(model, LlamaCppModel) else dtype_name(model.dtype)
