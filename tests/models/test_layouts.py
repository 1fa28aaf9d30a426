"""Layouts: layer-walking runners reach the described decoders and refuse the others by name; ALiBi models
without a description refuse token trees, not chains; walks stop at a sliding window they cannot mask."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from accelgen.draft import tree_attention
from accelgen.drafters.self_speculative import skipping_runner
from accelgen.models.layouts import decoder_layout
from accelgen.models.runner import ModelRunner

SHAPE = dict(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, initializer_range=0.2)


def _tiny(model_type: str, **options):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SHAPE, **options)).eval()


@pytest.mark.parametrize("model_type, reason", [
    ("opt", "its MLP is not one module"),
    ("gemma3_text", "rotary embeddings differ by layer type"),
    ("bloom", "ALiBi"),
    ("bamba", "it is not described"),
])
def test_a_layout_without_a_description_is_refused_by_name(model_type, reason):
    expected = (rf"layer skipping walks the decoder one sub-block at a time, which {model_type} does not allow "
                rf"\(.*{reason}.*\); layouts described: cohere, falcon, gemma")
    with pytest.raises(ValueError, match=expected):
        decoder_layout(AutoConfig.for_model(model_type), "layer skipping")


def test_parallel_residuals_pick_the_parallel_layout():
    assert decoder_layout(AutoConfig.for_model("gpt_neox"), "x").parallel  # GPT-NeoX's default
    assert not decoder_layout(AutoConfig.for_model("gpt_neox", use_parallel_residual=False), "x").parallel
    stablelm = decoder_layout(AutoConfig.for_model("stablelm", use_parallel_residual=True), "x")
    assert stablelm.parallel and stablelm.mlp_norm == "input_layernorm"  # one norm feeds both


def test_skipping_a_parallel_layers_mlp_leaves_its_attention(assert_reordered):
    """GPT-J: attention and MLP both read the layer's input; skipping every MLP equals zeroing their output."""
    model = _tiny("gptj", n_embd=64, n_layer=2, n_head=4, rotary_dim=8)
    tokens = torch.tensor([5, 9, 13, 17])
    skipped = skipping_runner(model, skip_attention=[], skip_mlp=[0, 1]).forward(tokens)
    for block in model.transformer.h:
        torch.nn.init.zeros_(block.mlp.fc_out.weight)
        torch.nn.init.zeros_(block.mlp.fc_out.bias)
    assert_reordered(skipped, ModelRunner(model).forward(tokens))


def test_an_undescribed_alibi_model_refuses_trees_but_not_chains():
    model = _tiny("falcon", alibi=True)
    runner = ModelRunner(model)
    runner.forward(torch.tensor([5, 9, 13]))  # a chain: the model's own forward
    with pytest.raises(ValueError, match="falcon with alibi=True: accelgen cannot score token trees"):
        runner.forward(torch.tensor([40, 41, 42]), tree_attention(torch.tensor([-1, -1])))


def test_a_walk_stops_where_the_sliding_window_would_leave_positions_out():
    model = _tiny("mistral", intermediate_size=128, num_key_value_heads=2, sliding_window=4)
    runner = skipping_runner(model, skip_attention=[1], skip_mlp=[])
    runner.forward(torch.tensor([5, 9, 13, 17]))  # positions 0..3: inside the window
    with pytest.raises(ValueError, match="within its sliding window of 4 positions; this sequence reaches position 4"):
        runner.forward(torch.tensor([21]))


def test_only_runners_that_a_padded_batch_scores_exactly_share_batched_forwards():
    assert ModelRunner(_tiny("llama", intermediate_size=128)).shares_batched_forward
    assert ModelRunner(_tiny("mistral", intermediate_size=128, max_position_embeddings=64,
                             sliding_window=64)).shares_batched_forward  # the window covers the context
    assert not ModelRunner(_tiny("mistral", intermediate_size=128, sliding_window=4)).shares_batched_forward
    assert not ModelRunner(_tiny("bloom", n_layer=2, n_head=4)).shares_batched_forward
