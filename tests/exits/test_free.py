"""FREE: the Beta-mixture threshold, the shallow-deep rule, and the method's ends (never exit, always exit)."""

import random

import pytest
import torch

import accelgen
from accelgen.exits.free import (INITIAL_THRESHOLD, MIN_SAMPLES, ShallowDeepExit, adaptive_threshold,
                                 agreement_posterior, fit_beta, top_probability)

CHAT = [{"role": "user", "content": "Name three colours."}]


def draws(a, b, count, seed):
    rng = random.Random(seed)
    return [rng.betavariate(a, b) for _ in range(count)]


def test_method_of_moments_recovers_a_beta():
    a, b = fit_beta(draws(8, 2, 20000, seed=0))
    assert a == pytest.approx(8, rel=0.1) and b == pytest.approx(2, rel=0.1)


def test_agreement_is_more_likely_at_higher_confidence_and_the_threshold_follows_the_target():
    agreeing, disagreeing = draws(8, 2, 400, seed=1), draws(2, 5, 400, seed=2)
    fits = fit_beta(agreeing), fit_beta(disagreeing)
    posteriors = [agreement_posterior(c / 10, *fits, prior=0.5) for c in range(1, 10)]
    assert posteriors == sorted(posteriors) and posteriors[0] < 0.1 < 0.9 < posteriors[-1]
    loose, strict = adaptive_threshold(agreeing, disagreeing, 0.6), adaptive_threshold(agreeing, disagreeing, 0.99)
    assert 0.2 < loose < strict < 1.0
    assert adaptive_threshold(draws(2, 2, 100, 3), draws(2, 2, 100, 4), 0.999) == 1.0  # confidence tells nothing


def test_the_rule_refits_its_threshold_from_what_the_deep_model_says():
    rule = ShallowDeepExit(exit_layer=3, agreement=0.9, fixed_threshold=None)
    sure, unsure = torch.tensor([[9.0, 0.0, 0.0]]), torch.tensor([[0.3, 0.0, 0.2]])
    deep_first, deep_second = torch.tensor([[5.0, 0.0, 0.0]]), torch.tensor([[0.0, 5.0, 0.0]])
    for step in range(MIN_SAMPLES):
        rule.observe(3, sure + 0.1 * step, deep_first)  # confident and right
        assert rule.threshold == INITIAL_THRESHOLD  # too few disagreements seen yet
        rule.observe(3, unsure + 0.01 * step, deep_second)  # unsure and wrong
    rule.observe(5, unsure, deep_second)  # another layer: ignored
    assert len(rule.agreeing) == len(rule.disagreeing) == MIN_SAMPLES
    assert top_probability(unsure[0]) < rule.threshold < top_probability(sure[0])


def test_threshold_one_is_the_full_model_and_zero_always_exits(smollm):
    model, tokenizer = smollm
    expected = accelgen.generate(model, tokenizer, CHAT, max_new_tokens=16)
    never = accelgen.generate(model, tokenizer, CHAT, method="free", max_new_tokens=16, threshold=1.0)
    assert never.token_ids == expected.token_ids and never.stats["mean_layers"] == 30
    always = accelgen.generate(model, tokenizer, CHAT, method="free", max_new_tokens=16, threshold=0.0, exit_layer=19)
    assert always.stats["mean_layers"] == 20 and len(always.token_ids) == 16


@pytest.mark.parametrize("options, problem", [
    ({"exit_layer": 1}, "exit_layer must be a layer below the last \\(0..0\\)"),
    ({"threshold": "auto"}, "threshold must be 'adaptive' or a number"),
    ({"agreement": 1.0}, "agreement must be in \\(0, 1\\)"),
])
def test_bad_options_are_named(tiny_target, tokenizer, options, problem):
    with pytest.raises(ValueError, match=problem):
        accelgen.generate(tiny_target, tokenizer, [5, 6], method="free", **options)
