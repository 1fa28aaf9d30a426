"""MPEE: threshold 1 is the full model, lower thresholds exit earlier, exits come through the trained adapters, the
horizontal perspective reads attention right and keep_ratio=1 prunes nothing, and bad input is named."""

import copy

import pytest
import torch

import accelgen
from accelgen.exits.mpee import attention_received, least_attended_mask, make_rule
from accelgen.heads.mpee import MpeeHeads
from accelgen.models.early_exit import EarlyExitRunner

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [5, 17, 923, 4410, 77, 12]
EXITS = [0, 1, 2]


@pytest.fixture(scope="module")
def four_layers(make_tiny_model):
    return make_tiny_model("qwen2", seed=0, layers=4)


def random_heads(model, seed: int = 3, scale: float = 0.3) -> MpeeHeads:
    """Heads with every weight random (adapters too), so that exits differ from the plain ones and confidences
    spread over (0, 1), deeper exits more confident (as trained ones are)."""
    heads = MpeeHeads.for_model(model, EXITS, rank=8)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
        for depth, layer in enumerate(heads.layers):
            heads.classifiers[str(layer)].bias += depth
    return heads


@pytest.fixture(scope="module")
def heads_folder(four_layers, tmp_path_factory):
    folder = tmp_path_factory.mktemp("mpee_heads")
    random_heads(four_layers).save(folder)
    return folder


def test_threshold_one_is_the_full_model(four_layers, tokenizer, heads_folder, greedy):
    expected = greedy(four_layers, tokenizer, PROMPT, 16)
    result = accelgen.generate(four_layers, tokenizer, PROMPT, method="mpee", max_new_tokens=16, heads=str(heads_folder),
                               threshold=1.0)
    assert result.token_ids == expected.token_ids
    assert result.stats["mean_layers"] == result.stats["layers"] == 4


def test_threshold_zero_leaves_every_token_at_the_first_exit_through_its_adapter(four_layers, tokenizer, heads_folder):
    """Every decoded token leaves after layer 0, whose cache is then exact: its logits are the full forward's layer-0
    state through exit 0's adapter, the final norm and the LM head (the first token comes from the prompt's forward)."""
    result = accelgen.generate(four_layers, tokenizer, PROMPT, method="mpee", max_new_tokens=8, heads=str(heads_folder),
                               threshold=0.0, output_scores=True)
    assert result.stats["mean_layers"] == 1
    heads = MpeeHeads.load(heads_folder, four_layers)
    with torch.inference_mode():
        output = four_layers(torch.tensor([PROMPT + result.token_ids[:-1]]), output_hidden_states=True)
        hidden = output.hidden_states[1][0, len(PROMPT):]  # (7, d) after layer 0
        exits = four_layers.lm_head(four_layers.model.norm(heads.adapt(0, hidden, heads.features(0, hidden, None))))
    logits = torch.cat([output.logits[0, len(PROMPT) - 1 : len(PROMPT)], exits]).float()
    torch.testing.assert_close(result.scores, logits, rtol=1e-4, atol=1e-4)
    plain = four_layers.lm_head(four_layers.model.norm(hidden)).argmax(-1)
    assert plain.tolist() != result.token_ids[1:]  # the adapter moved the exits


def test_lower_thresholds_exit_earlier(four_layers, heads_folder):
    """From the same state, a lower threshold leaves at the same layer or earlier: all 4 layers at 1.0, layer 0 at 0."""
    heads = MpeeHeads.load(heads_folder, four_layers)
    context = PROMPT + [88, 301, 2048, 7, 999, 64]
    thresholds = [step / 20 for step in range(20, -1, -1)]  # 1.0, 0.95, ..., 0.0
    seen = set()
    for end in range(len(PROMPT), len(context)):
        prompt = EarlyExitRunner(four_layers, make_rule(four_layers, heads, threshold=1.0))
        prompt.forward(torch.tensor(context[:end]))
        depths = []
        for threshold in thresholds:
            rule = make_rule(four_layers, heads, threshold=threshold)
            runner = EarlyExitRunner(four_layers, rule, heads=rule)
            runner.cache = copy.deepcopy(prompt.cache)
            runner.forward(torch.tensor([context[end]]))
            depths += runner.layers_used
        assert depths == sorted(depths, reverse=True) and depths[0] == 4 and depths[-1] == 1
        seen |= set(depths)
    assert len(seen) >= 3  # the thresholds in between exit in between too


def test_attention_received_is_the_models_own_attention(make_tiny_model):
    """The horizontal perspective's recomputed attention equals the model's eager attention weights (grouped-query
    heads, rotary positions, averaged over heads) for the last token over the positions before it."""
    model = make_tiny_model("llama", seed=1, layers=2)
    model.config._attn_implementation = "eager"
    tokens = torch.tensor([PROMPT + [42]])
    with torch.inference_mode():
        output = model(tokens, output_attentions=True, output_hidden_states=True, use_cache=True)
        prompt = EarlyExitRunner(model, make_rule(model, random_heads_for(model), threshold=1.0))
        prompt.forward(tokens[0, :-1])
        position = torch.tensor([[len(PROMPT)]])
        walk = prompt.decoder.walk_inputs(output.hidden_states[1][:, -1:], position)
        for index in range(2):
            received = attention_received(prompt.decoder, index, output.hidden_states[index][:, -1:],
                                          prompt.cache.layers[index].keys, walk["position_embeddings"])
            row = output.attentions[index][0, :, -1, :-1]  # (heads, n): the last token's, itself left out
            expected = (row / row.sum(dim=-1, keepdim=True)).mean(dim=0)
            torch.testing.assert_close(received, expected.float(), rtol=1e-4, atol=1e-5)


def random_heads_for(model) -> MpeeHeads:
    return MpeeHeads.for_model(model, [0], rank=4)


def test_the_least_attended_positions_are_masked_and_the_token_itself_never():
    mask = least_attended_mask(torch.tensor([0.1, 0.5, 0.05, 0.3, 0.05]), 0.4, torch.float32)
    assert mask.shape == (1, 1, 1, 6)
    assert (mask[0, 0, 0] == 0).tolist() == [False, True, False, True, False, True]
    assert (least_attended_mask(torch.tensor([0.7, 0.3]), 0.01, torch.float32)[0, 0, 0] == 0).tolist() == [True, False, True]


def test_keep_ratio_one_is_the_vertical_perspective_alone(four_layers, tokenizer, heads_folder):
    options = dict(method="mpee", max_new_tokens=16, heads=str(heads_folder), threshold=0.5)
    vertical = accelgen.generate(four_layers, tokenizer, PROMPT, **options)
    assert accelgen.generate(four_layers, tokenizer, PROMPT, keep_ratio=1.0, **options).token_ids == vertical.token_ids
    assert 1 < vertical.stats["mean_layers"] < 4
    pruned = accelgen.generate(four_layers, tokenizer, PROMPT, keep_ratio=0.2, output_scores=True, **options)
    full = accelgen.generate(four_layers, tokenizer, PROMPT, output_scores=True, **options)
    assert not torch.allclose(pruned.scores[1:], full.scores[1:])  # pruning changes what upper layers see


def test_pruning_masks_the_least_attended_context_from_prune_from_up(four_layers, heads_folder):
    """With threshold 1 and prune_from=2, a token's layers 0-1 see all the context and layers 2-3 only the kept
    part: the same as the full model's forward with those positions masked in layers 2-3 alone."""
    heads = MpeeHeads.load(heads_folder, four_layers)
    rule = make_rule(four_layers, heads, threshold=1.0, keep_ratio=0.5, prune_from=2)
    runner = EarlyExitRunner(four_layers, rule, heads=rule)
    runner.forward(torch.tensor(PROMPT))
    logits = runner.forward(torch.tensor([88]))[0]
    kept = rule.context[0, 0, 0] == 0  # (n + 1,) what layers 2-3 saw
    assert int(kept.sum()) == 3 + 1  # half the 6 positions, and the token itself
    reference = EarlyExitRunner(four_layers, make_rule(four_layers, heads, threshold=1.0))
    reference.forward(torch.tensor(PROMPT))
    decoder = reference.decoder
    with torch.inference_mode():
        hidden = decoder.embed(torch.tensor([88]), torch.tensor([[len(PROMPT)]]))
        walk = reference._walk_inputs([len(PROMPT)], hidden)
        for index in range(4):
            mask = None if index < 2 else rule.context
            hidden = decoder.layer(decoder.layers[index], hidden, mask=mask, **walk)
        expected = decoder.logits(hidden)[0, 0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    unpruned = EarlyExitRunner(four_layers, make_rule(four_layers, heads, threshold=1.0))
    unpruned.forward(torch.tensor(PROMPT))
    assert not torch.allclose(unpruned.forward(torch.tensor([88]))[0], logits)


@pytest.mark.parametrize("options, problem", [
    ({}, "mpee needs trained heads: heads=FOLDER, from `accelgen train mpee --out FOLDER`"),
    ({"threshold": 1.5}, "threshold must be a number in \\[0, 1\\]"),
    ({"keep_ratio": 0.0}, "keep_ratio must be a number in \\(0, 1\\]"),
    ({"prune_from": 9}, "prune_from must be a layer, 0..3"),
])
def test_bad_options_are_named(four_layers, tokenizer, heads_folder, options, problem):
    if options:
        options = {"heads": str(heads_folder), **options}
    with pytest.raises(ValueError, match=problem):
        accelgen.generate(four_layers, tokenizer, PROMPT, method="mpee", max_new_tokens=4, **options)


def test_heads_for_another_model_are_refused(make_tiny_model, tokenizer, heads_folder):
    same_shape = make_tiny_model("qwen2", seed=7, layers=4)
    with pytest.raises(ValueError, match="MPEE heads were trained for .* weights differ"):
        accelgen.generate(same_shape, tokenizer, PROMPT, method="mpee", heads=str(heads_folder), max_new_tokens=4)
    with pytest.raises(ValueError, match="layer count 4, the model's is 2"):
        accelgen.generate(make_tiny_model("qwen2", seed=0, layers=2), tokenizer, PROMPT, method="mpee",
                          heads=str(heads_folder), max_new_tokens=4)
