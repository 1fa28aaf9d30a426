"""PPD: the next token's candidates start early; a hit reuses their first layers, and the output is the model's."""

import pytest
import torch

import accelgen
from accelgen.exits.ppd import make_runner
from accelgen.models.runner import ModelRunner

PROMPT = [5, 17, 923, 4410, 77, 12]
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def six_layers(make_tiny_model):
    return make_tiny_model("qwen2", seed=5, layers=6)


def test_hits_and_misses_give_the_models_own_logits(six_layers, assert_reordered):
    runner = make_runner(six_layers, pipeline_layer=3, candidates=2)
    reference = ModelRunner(six_layers)
    assert_reordered(runner.forward(torch.tensor(PROMPT)), reference.forward(torch.tensor(PROMPT)))
    assert runner.precomputed == 2  # layers 4 and 5 are left when the candidates start: they get as many
    decoded = []
    for step in range(6):
        candidates = runner.candidates.tokens if runner.candidates else []
        token = candidates[step % 2] if step % 3 else 7  # hits on both candidates, and misses
        decoded.append(token in candidates)
        assert_reordered(runner.forward(torch.tensor([token])), reference.forward(torch.tensor([token])))
        assert runner.length == reference.length
    stats = runner.describe()
    assert stats["hit_rate"] == sum(decoded) / 6 == pytest.approx(4 / 6)
    assert stats["mean_layers"] == pytest.approx((6 * 6 - 4 * 2) / 6)
    assert stats["compute"] == pytest.approx((6 * 6 - 4 * 2 + 6 * 2 * 2) / (6 * 6))


def test_greedy_output_is_the_models_own(smollm):
    model, tokenizer = smollm
    expected = accelgen.generate(model, tokenizer, CHAT, max_new_tokens=24)
    result = accelgen.generate(model, tokenizer, CHAT, method="ppd", max_new_tokens=24, candidates=4)
    assert result.token_ids == expected.token_ids
    assert 0 < result.stats["hit_rate"] < 1 and result.stats["mean_layers"] < 30 < 30 * result.stats["compute"]


def test_sampling_draws_exactly_what_the_model_draws(six_layers, tokenizer):
    hit_rates = []
    for seed in range(3):
        plain = accelgen.generate(six_layers, tokenizer, PROMPT, temperature=1.0, seed=seed, max_new_tokens=12)
        ppd = accelgen.generate(six_layers, tokenizer, PROMPT, method="ppd", temperature=1.0, seed=seed,
                                max_new_tokens=12, pipeline_layer=3, candidates=50)
        assert ppd.token_ids == plain.token_ids
        hit_rates.append(ppd.stats["hit_rate"])
    assert 0 < max(hit_rates)


def test_bad_options_are_refused(six_layers, tokenizer):
    with pytest.raises(ValueError, match="pipeline_layer must be in 1..4"):
        accelgen.generate(six_layers, tokenizer, PROMPT, method="ppd", pipeline_layer=5)
    with pytest.raises(ValueError, match="candidates must be in"):
        accelgen.generate(six_layers, tokenizer, PROMPT, method="ppd", candidates=0)
