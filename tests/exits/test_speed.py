"""SPEED: tokens at different depths share one pass through a cycle of shared layers; guesses that hit keep their
work, misses restart, and the output is the model's own."""

import pytest
import torch

import accelgen
from accelgen.exits.speed import SpeedRunner
from accelgen.models import shared_cycle
from accelgen.models.runner import ModelRunner

PROMPT = [5, 17, 923, 441, 77, 12]
VOCAB = 1024

pytestmark = pytest.mark.usefixtures("one_thread")


def shared(cycle=2, repeats=3, seed=0):
    """A tiny random shared-cycle model with peaked logits (clear argmaxes, as a trained model's)."""
    return shared_cycle.build(VOCAB, cycle=cycle, repeats=repeats, hidden_size=64, intermediate_size=128, heads=4,
                              kv_heads=2, seed=seed, initializer_range=0.2)


@pytest.fixture(scope="module")
def passthrough():
    """Layers that add nothing (attention and MLP outputs zeroed): every exit reads what the last layer reads, so
    every guess is right."""
    model = shared(cycle=2, repeats=3, seed=4)
    with torch.no_grad():
        for layer in model.model.layers[:2]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def plain_and_speed(model, tokenizer, max_new_tokens, **request):
    plain = accelgen.generate(model, tokenizer, PROMPT, max_new_tokens=max_new_tokens, **request)
    speed = accelgen.generate(model, tokenizer, PROMPT, method="speed", max_new_tokens=max_new_tokens, **request)
    return plain, speed


@pytest.mark.parametrize("cycle, repeats, seed", [(2, 3, 0), (4, 3, 1), (1, 2, 2), (3, 4, 3)])
def test_greedy_output_is_the_models_own(tokenizer, cycle, repeats, seed):
    plain, speed = plain_and_speed(shared(cycle, repeats, seed), tokenizer, 30)
    assert speed.token_ids == plain.token_ids
    stats = speed.stats
    steps = len(speed.token_ids) - 1  # the first token comes from the prompt's forward
    passes = stats["hit_rate"] * steps + repeats * (steps - stats["hit_rate"] * steps)
    assert stats["weight_loads_per_token"] == pytest.approx(cycle * passes / steps)
    assert stats["layers"] == cycle * repeats


def test_some_guesses_hit_and_some_miss(tokenizer):
    rates = [plain_and_speed(shared(2, 3, seed), tokenizer, 30)[1].stats["hit_rate"] for seed in range(4)]
    assert any(0 < rate < 1 for rate in rates)


def test_when_every_guess_hits_each_token_takes_one_pass(passthrough, tokenizer):
    plain, speed = plain_and_speed(passthrough, tokenizer, 20)
    assert speed.token_ids == plain.token_ids
    steps = 19  # the first decoding step has nothing in flight: 3 passes; then one each
    assert speed.stats["hit_rate"] == pytest.approx(18 / 19)
    assert speed.stats["weight_loads_per_token"] == pytest.approx(2 * (3 + 18) / steps)
    assert speed.stats["misses"] == 0 and speed.stats["cold_starts"] == 1


def test_when_every_guess_misses_each_token_takes_every_layer(passthrough, tokenizer):
    """A processor that bans the model's top token: the committed token is never the guess."""

    def ban_top(context, logits):
        logits = logits.clone()
        logits[logits.argmax()] = float("-inf")
        return logits

    plain, speed = plain_and_speed(passthrough, tokenizer, 16, logits_processors=[ban_top])
    assert speed.token_ids == plain.token_ids
    assert speed.stats["hit_rate"] == 0 and speed.stats["misses"] == 14
    assert speed.stats["weight_loads_per_token"] == pytest.approx(6)  # as plain decoding: 2 layers x 3 repeats


def test_eos_and_short_requests_stop_where_plain_decoding_does(tokenizer):
    model = shared(2, 3, 0)
    reference = accelgen.generate(model, tokenizer, PROMPT, max_new_tokens=20).token_ids
    eos = {reference[7]}
    plain, speed = plain_and_speed(model, tokenizer, 20, eos_ids=eos)
    assert speed.token_ids == plain.token_ids and speed.finish_reason == plain.finish_reason == "stop"
    for max_new_tokens in (1, 2, 3):
        plain, speed = plain_and_speed(model, tokenizer, max_new_tokens)
        assert speed.token_ids == plain.token_ids == reference[:max_new_tokens]


def test_sampling_draws_exactly_what_the_model_draws(tokenizer):
    model = shared(2, 3, 1)
    for seed in range(3):
        plain, speed = plain_and_speed(model, tokenizer, 16, temperature=1.0, seed=seed)
        assert speed.token_ids == plain.token_ids


def test_hits_and_misses_give_the_models_own_logits(assert_reordered):
    model = shared(2, 3, 5)
    runner, reference = SpeedRunner(model), ModelRunner(model)
    assert_reordered(runner.forward(torch.tensor(PROMPT)), reference.forward(torch.tensor(PROMPT)))
    hits = 0
    for step in range(8):
        guessed = runner.flights[0].token if runner.flights else None
        token = guessed if step % 3 and guessed is not None else 7 + step  # hits, and misses
        hits += token == guessed
        assert_reordered(runner.forward(torch.tensor([token])), reference.forward(torch.tensor([token])))
        assert runner.length == reference.length
        runner.keep(runner.length - 1, [0])  # what the loop does after each step: nothing to roll back
    assert runner.describe()["hit_rate"] == pytest.approx(hits / 8) and hits > 0


def test_a_model_that_does_not_share_weights_in_a_cycle_is_refused(make_tiny_model, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="speed needs a model whose decoder layers share weights in a cycle"):
        accelgen.generate(make_tiny_model("llama", layers=4), tokenizer, PROMPT, method="speed")
    shared_cycle.save(shared(), tokenizer, tmp_path)
    from transformers import AutoModelForCausalLM

    copies = AutoModelForCausalLM.from_pretrained(tmp_path)  # the cycle declared, the layers loaded as copies
    with pytest.raises(ValueError, match="not layer 0's .*shared_cycle.load"):
        accelgen.generate(copies, tokenizer, PROMPT, method="speed")


def test_a_one_token_prompt_goes_through_the_pipeline_from_the_start(tokenizer):
    model = shared(2, 3, 0)
    plain = accelgen.generate(model, tokenizer, [5], max_new_tokens=12)
    speed = accelgen.generate(model, tokenizer, [5], method="speed", max_new_tokens=12)
    assert speed.token_ids == plain.token_ids and speed.stats["cold_starts"] == 1
