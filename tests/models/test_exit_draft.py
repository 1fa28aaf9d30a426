"""LayerSkip's shared cache: verification reuses the draft's lower layers and gives the model's own logits."""

import pytest
import torch

from accelgen.models.exit_draft import ExitDraftRunner
from accelgen.models.runner import ModelRunner

PROMPT = [5, 17, 923, 4410, 77, 12]
DRAFT = [301, 42, 7]


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
