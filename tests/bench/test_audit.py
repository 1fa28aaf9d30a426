"""The divergence classifier: numerical near-tie or error, with dtype-aware tolerances."""

from __future__ import annotations

import pytest
import torch

import accelgen
from accelgen.bench.audit import audit, classify, first_difference
from accelgen.bench.near_tie import TIE_ULPS, is_near_tie, tie_tolerance, ulp


def logits_with(values: dict[int, float], vocab: int = 16, rest: float = -5.0) -> torch.Tensor:
    logits = torch.full((vocab,), rest)
    for token, value in values.items():
        logits[token] = value
    return logits


def test_ulp_follows_the_dtype_and_magnitude():
    assert ulp(16.125, torch.bfloat16) == 1 / 8  # [16, 32): 8 significant bits
    assert ulp(15.0, torch.bfloat16) == 1 / 16
    assert ulp(-20.0, torch.bfloat16) == 1 / 8
    assert ulp(16.0, torch.float16) == 1 / 64
    assert ulp(0.0, torch.bfloat16) > 0
    # the tolerance is a whole number of representable steps of bf16 at that magnitude
    value = torch.tensor(16.125, dtype=torch.bfloat16)
    assert float(torch.nextafter(value, torch.tensor(100.0, dtype=torch.bfloat16)) - value) == ulp(16.125, torch.bfloat16)


def test_tie_tolerance_is_a_few_ulps_and_none_in_float32():
    assert tie_tolerance(torch.bfloat16, 16.125) == TIE_ULPS / 8
    assert tie_tolerance(torch.bfloat16, 3.0) == TIE_ULPS / 64
    assert tie_tolerance(torch.float32, 16.0) is None


def test_exact_bf16_tie_is_a_near_tie():
    # the case measured in the design notes: the two best logits both exactly 16.125
    divergence = classify(logits_with({3: 16.125, 7: 16.125}), 5, baseline_token=3, method_token=7, dtype=torch.bfloat16)
    assert divergence.classification == "near-tie"
    assert {divergence.top1_token, divergence.top2_token} == {3, 7}
    assert divergence.margin == 0.0 and divergence.position == 5


def test_bf16_within_tolerance_is_a_near_tie_beyond_is_an_error():
    within = classify(logits_with({3: 16.5, 7: 16.125}), 0, 3, 7, torch.bfloat16)  # 3 ulps apart
    assert within.classification == "near-tie"
    beyond = classify(logits_with({3: 17.0, 7: 16.125}), 0, 3, 7, torch.bfloat16)  # 7 ulps apart
    assert beyond.classification == "error" and "below the best logit" in beyond.reason


def test_method_token_far_down_the_ranking_is_an_error_even_if_the_top_two_tie():
    divergence = classify(logits_with({3: 16.125, 4: 16.125, 7: 2.0}), 0, 3, 7, torch.bfloat16)
    assert divergence.classification == "error"
    assert divergence.method_token_logit == 2.0


def test_float32_divergence_is_always_an_error():
    divergence = classify(logits_with({3: 16.125, 7: 16.125}), 0, 3, 7, torch.float32)
    assert divergence.classification == "error" and "float32" in divergence.reason


def test_is_near_tie_is_the_rule_the_classifier_applies():
    logits = logits_with({3: 16.5, 7: 16.125, 9: 15.0})
    assert is_near_tie(logits, 3, 7, torch.bfloat16)  # 3 ulps below the best
    assert not is_near_tie(logits, 3, 9, torch.bfloat16)  # 12 ulps below
    assert not is_near_tie(logits, 3, 7, torch.float32)
    assert is_near_tie(logits, 3, 9, None, tolerance=1.5)  # an engine's own tolerance (llama.cpp)


@pytest.mark.parametrize("baseline, other, expected", [
    ([1, 2, 3], [1, 2, 3], None),
    ([1, 2, 3], [1, 5, 3], 1),
    ([1, 2, 3], [1, 2], 2),
    ([], [4], 0),
])
def test_first_difference(baseline, other, expected):
    assert first_difference(baseline, other) == expected


def test_audit_recomputes_the_baseline_logits_without_cache(tiny_target, tokenizer):
    prompt = [1, 400, 401, 402]
    baseline = accelgen.generate(tiny_target, tokenizer, prompt, max_new_tokens=6).token_ids
    wrong = baseline[:3] + [(baseline[3] + 1) % 49152] + baseline[4:]
    divergence = audit(tiny_target, prompt, baseline, wrong)
    assert divergence.position == 3
    assert divergence.top1_token == baseline[3]  # the plain forward agrees with the cached greedy run
    assert divergence.classification == "error"  # float32 model
    assert audit(tiny_target, prompt, baseline, list(baseline)) is None
    shorter = audit(tiny_target, prompt, baseline, baseline[:4])
    assert shorter.position == 4 and shorter.method_token is None and shorter.classification == "error"
