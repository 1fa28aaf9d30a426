"""LayerSkip self-speculation: drafts from an early exit of the target itself, verified reusing the draft's cache;
lossless, exact sampling."""

import copy

import pytest
import torch

import accelgen
from accelgen.drafters.layerskip import ExitDraftRunner
from accelgen.models.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]
DRAFT = [301, 42, 7]


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
    result = assert_lossless(model, tokenizer, copy_prompt, "layerskip", 24, draft_budget="method", exit_layer=19)
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


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(assert_samples_target):
    assert_samples_target("layerskip", [1, 3, 4], exit_layer=0)


def test_an_exit_at_the_last_layer_is_refused(tiny_target, tokenizer):
    with pytest.raises(ValueError, match="exit_layer must be a layer below the last \\(0..0\\)"):
        accelgen.generate(tiny_target, tokenizer, [5, 6], method="layerskip", exit_layer=1)


# the shared cache: verification reuses the draft's lower layers and gives the model's own logits


@pytest.fixture(scope="module")
def four_layers(make_tiny_model):
    return make_tiny_model("qwen2", seed=5, layers=4)


def rows_through(layer) -> list[int]:
    """Records the number of token rows of each call of a layer's MLP."""
    rows = []
    layer.mlp.register_forward_hook(lambda module, inputs, output: rows.append(inputs[0].shape[1]))
    return rows


def test_verification_starts_drafted_tokens_above_the_exit(make_tiny_model, assert_reordered):
    model = make_tiny_model("qwen2", seed=5, layers=4)
    runner, reference = ExitDraftRunner(model, exit_layer=1), ModelRunner(model)
    lower, upper = rows_through(model.model.layers[0]), rows_through(model.model.layers[2])
    runner.draft.keep(0, [])
    runner.draft.forward(torch.tensor(PROMPT))  # the drafter catches up, then drafts two tokens one by one
    runner.draft.forward(torch.tensor(DRAFT[:1]))
    runner.draft.forward(torch.tensor(DRAFT[1:2]))
    assert lower == [len(PROMPT), 1, 1] and upper == []
    tokens = torch.tensor(PROMPT + DRAFT)
    logits = runner.forward(tokens)
    assert lower[-1] == 1  # only the last draft token, never fed to the draft, goes through the lower layers
    assert upper == [len(tokens)]
    # the lower layers ran 1-row products where the reference ran 9 rows at once: fp32 rounding differs slightly
    assert_reordered(logits, reference.forward(tokens))
    runner.keep(len(PROMPT), [0, 1])  # the first draft token accepted: all layers hold the same positions again
    reference.keep(len(PROMPT), [0, 1])
    assert runner.length == runner.lower_length == len(PROMPT) + 2 and runner.exit_states is None
    assert_reordered(runner.forward(torch.tensor([9])), reference.forward(torch.tensor([9])))


def test_a_verified_token_the_draft_never_fed_is_not_fed_again(four_layers, assert_reordered):
    runner, reference = ExitDraftRunner(four_layers, exit_layer=2), ModelRunner(four_layers)
    runner.draft.keep(0, [])
    runner.draft.forward(torch.tensor(PROMPT))
    runner.forward(torch.tensor(PROMPT + DRAFT[:1]))  # the draft token is accepted: the cache holds it
    runner.keep(0, list(range(len(PROMPT) + 1)))
    runner.draft.keep(len(PROMPT), [])  # the drafter rolls back to the tokens it fed, then feeds the rest
    logits = runner.draft.forward(torch.tensor(DRAFT[:2]), logits_for_last=1)
    assert runner.lower_length == len(PROMPT) + 2 and runner.exit_states.shape[1] == 1
    reference.forward(torch.tensor(PROMPT + DRAFT[:1]))
    assert_reordered(runner.forward(torch.tensor(DRAFT[1:3])), reference.forward(torch.tensor(DRAFT[1:3])))
    assert logits.shape == (1, four_layers.config.vocab_size)


def test_trees_are_refused(four_layers):
    with pytest.raises(ValueError, match="chains"):
        ExitDraftRunner(four_layers, exit_layer=1).forward(torch.tensor([1, 2]), tree=torch.ones(2, 2, dtype=torch.bool))
