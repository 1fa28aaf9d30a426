"""Learn-then-Test for CALM's threshold: a valid p-value, fixed-sequence testing that stops at the first
non-rejection, and the whole calibration on SmolLM2."""

import math
import random

import pytest

from accelgen.train.calibrate import calibrate_calm, hoeffding_bentkus_p_value, learn_then_test


def test_p_value_is_the_smaller_of_the_hoeffding_and_bentkus_bounds():
    # no loss in 22 prompts: Hoeffding's exp(−n·kl(0 ‖ ε)) = (1 − ε)^n, below Bentkus's e · (1 − ε)^n
    assert hoeffding_bentkus_p_value(0.0, 22, 0.1) == pytest.approx(0.9**22)
    # 5 losses in 100: Bentkus's e · P(Bin(100, 0.1) ≤ 5) ≈ 0.157 is below Hoeffding's ≈ 0.188
    tail = sum(math.comb(100, i) * 0.1**i * 0.9 ** (100 - i) for i in range(6))
    assert hoeffding_bentkus_p_value(0.05, 100, 0.1) == pytest.approx(math.e * tail)


def test_p_value_falls_with_the_observed_risk_and_the_sample_size():
    assert hoeffding_bentkus_p_value(0.2, 50, 0.1) == 1.0  # above the tolerance: nothing to reject
    assert hoeffding_bentkus_p_value(0.0, 50, 0.1) < hoeffding_bentkus_p_value(0.05, 50, 0.1) < 1.0
    assert hoeffding_bentkus_p_value(0.0, 100, 0.1) < hoeffding_bentkus_p_value(0.0, 20, 0.1)
    assert hoeffding_bentkus_p_value(0.0, 22, 0.1) < 0.1  # (1 − ε)^n: 22 flawless prompts suffice at ε = δ = 0.1


def test_p_value_is_valid_when_the_risk_is_exactly_the_tolerance():
    """Under the null (true risk = ε), p ≤ δ must happen at most a δ share of the time."""
    rng = random.Random(0)
    n, epsilon, delta, trials = 60, 0.2, 0.1, 3000
    rejections = 0
    for _ in range(trials):
        risk = sum(rng.random() < epsilon for _ in range(n)) / n
        rejections += hoeffding_bentkus_p_value(risk, n, epsilon) <= delta
    assert rejections / trials <= delta


def test_testing_stops_at_the_first_threshold_not_rejected():
    risks = {0.99: 0.0, 0.9: 0.01, 0.8: 0.03, 0.7: 0.3, 0.6: 0.0}
    asked = []

    def risk_of(threshold):
        asked.append(threshold)
        return risks[threshold]

    chosen, tested = learn_then_test(list(risks), risk_of, n=200, epsilon=0.1, delta=0.1)
    assert chosen == 0.8 and asked == [0.99, 0.9, 0.8, 0.7]  # 0.6 would pass, but is never tested
    assert [row["rejected"] for row in tested] == [True, True, True, False]


def test_nothing_rejected_means_no_threshold():
    chosen, tested = learn_then_test([0.9, 0.8], lambda threshold: 0.5, n=100, epsilon=0.1, delta=0.1)
    assert chosen is None and len(tested) == 1


def test_calibration_on_smollm(smollm):
    model, tokenizer = smollm
    prompts = [tokenizer(text).input_ids for text in ("def add(a, b):\n", "The capital of France is", "1, 2, 3,")]
    result = calibrate_calm(model, tokenizer, prompts, measure="softmax", thresholds=[0.0, 0.999], epsilon=0.5,
                            delta=0.5, max_new_tokens=8)
    assert result["tested"][0]["threshold"] == 0.999 and result["prompts"] == 3  # safest first
    rejected = [row["threshold"] for row in result["tested"] if row["rejected"]]
    assert result["threshold"] == (rejected[-1] if rejected else 1.0)
    assert all(0.0 <= row["risk"] <= 1.0 for row in result["tested"])
