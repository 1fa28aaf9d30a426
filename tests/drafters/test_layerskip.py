"""LayerSkip self-speculation: drafts from an early exit of the target itself, verified reusing the draft's cache;
lossless, exact sampling."""

import copy

import pytest
import torch

import accelgen

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]


@pytest.fixture(scope="module")
def idle_top(make_tiny_model):
    """Three layers, the last one idle (its attention and MLP write nothing): an exit after layer 1 is the model's
    own prediction, so every draft is accepted."""
    model = make_tiny_model("qwen2", seed=3, layers=3)
    with torch.no_grad():
        model.model.layers[2].self_attn.o_proj.weight.zero_()
        model.model.layers[2].mlp.down_proj.weight.zero_()
    return model


def test_smollm_early_exit_drafts_are_lossless(smollm, copy_prompt, assert_lossless):
    model, tokenizer = smollm
    result = assert_lossless(model, tokenizer, copy_prompt, "layerskip", 24, exit_layer=19)
    assert 0 < result.stats["acceptance_rate"] < 1


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_drafts_all_accepted(idle_top, tokenizer, greedy, gamma):
    expected = greedy(idle_top, tokenizer, PROMPT, 30)
    result = accelgen.generate(idle_top, tokenizer, PROMPT, method="layerskip", max_new_tokens=30, exit_layer=1,
                               gamma=gamma)
    assert result.token_ids == expected.token_ids
    assert result.stats["acceptance_rate"] == 1.0


def test_drafts_rarely_accepted(tiny_target, tokenizer, greedy):
    expected = greedy(tiny_target, tokenizer, PROMPT, 30)
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, method="layerskip", max_new_tokens=30, exit_layer=0)
    assert result.token_ids == expected.token_ids
    assert result.stats["acceptance_rate"] < 0.5


@pytest.mark.parametrize("max_new_tokens", [1, 3])
def test_max_new_tokens_smaller_than_the_draft(idle_top, tokenizer, greedy, max_new_tokens):
    result = accelgen.generate(idle_top, tokenizer, PROMPT, method="layerskip", max_new_tokens=max_new_tokens,
                               exit_layer=1, gamma=8)
    assert result.token_ids == greedy(idle_top, tokenizer, PROMPT, max_new_tokens).token_ids
    assert result.stats["draft_tokens"] <= max_new_tokens - 1


def test_eos_inside_an_accepted_draft(idle_top, tokenizer, greedy):
    tokens = greedy(idle_top, tokenizer, PROMPT, 30).token_ids
    position = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    model = copy.deepcopy(idle_top)
    model.generation_config.eos_token_id = tokens[position]
    result = accelgen.generate(model, tokenizer, PROMPT, method="layerskip", max_new_tokens=30, exit_layer=1, gamma=8)
    assert result.token_ids == tokens[: position + 1] and result.finish_reason == "stop"


def test_sampling_keeps_the_target_distribution(assert_samples_target):
    assert_samples_target("layerskip", [1, 3, 4], exit_layer=0)


def test_an_exit_at_the_last_layer_is_refused(tiny_target, tokenizer):
    with pytest.raises(ValueError, match="exit_layer must be a layer below the last \\(0..0\\)"):
        accelgen.generate(tiny_target, tokenizer, [5, 6], method="layerskip", exit_layer=1)
