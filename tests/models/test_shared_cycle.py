"""A model whose layers share weights in a cycle: built, checked, saved and loaded with the sharing kept."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from accelgen.models import shared_cycle

TOKENS = torch.tensor([[5, 17, 300, 41, 7, 12, 99]])


def tiny(cycle=2, repeats=3, seed=0):
    return shared_cycle.build(512, cycle=cycle, repeats=repeats, hidden_size=32, intermediate_size=64, heads=4,
                              kv_heads=2, seed=seed)


def test_layers_share_the_tensors_of_their_cycle_layer_and_keep_their_own_cache_slot():
    model = tiny(cycle=2, repeats=3)
    layers = model.model.layers
    assert shared_cycle.cycle_and_repeats(model, "test") == (2, 3)
    assert layers[4].mlp.down_proj.weight is layers[0].mlp.down_proj.weight
    assert layers[5].self_attn.q_proj.weight is layers[1].self_attn.q_proj.weight
    assert layers[3].self_attn.q_proj.weight is not layers[0].self_attn.q_proj.weight
    assert [layer.self_attn.layer_idx for layer in layers] == list(range(6))  # one KV-cache layer each
    distinct = sum(parameter.numel() for parameter in layers[:2].parameters())
    assert sum(parameter.numel() for parameter in layers.parameters()) == distinct


def test_decoding_with_a_cache_matches_the_whole_sequence(assert_reordered):
    """Were the repeats sharing one cache layer, the second repeat would see the first's keys."""
    model = tiny()
    with torch.no_grad():
        whole = model(TOKENS).logits[0]
        cache = DynamicCache()
        first = model(TOKENS[:, :4], cache=cache, use_cache=True).logits[0]
        rest = [model(TOKENS[:, i : i + 1], cache=cache, use_cache=True).logits[0, 0] for i in range(4, 7)]
    assert_reordered(torch.cat([first, torch.stack(rest)]), whole)


def test_a_saved_model_loads_with_its_layers_shared_and_computes_the_same(tmp_path, tokenizer):
    model = tiny(seed=3)
    shared_cycle.save(model, tokenizer, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["shared_cycle"] == 2
    assert model.model.layers[2].mlp.up_proj.weight is model.model.layers[0].mlp.up_proj.weight  # saving kept it
    loaded, loaded_tokenizer = shared_cycle.load(tmp_path)
    assert shared_cycle.cycle_and_repeats(loaded, "test") == (2, 3)
    assert len(loaded_tokenizer) == len(tokenizer)
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, model(TOKENS).logits)


def test_a_plain_load_has_copies_which_tie_if_declared_ties(tmp_path, tokenizer):
    shared_cycle.save(tiny(), tokenizer, tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="layer 2's .* is not layer 0's .*shared_cycle.load"):
        shared_cycle.cycle_and_repeats(plain, "speed")
    assert shared_cycle.tie_if_declared(plain) is plain
    assert shared_cycle.cycle_and_repeats(plain, "speed") == (2, 3)


def test_load_model_ties_a_declared_cycle(tmp_path, tokenizer):
    """What `accelgen generate|bench --model DIR` loads: the layers shared again, so plain decoding and `speed`
    run the same model, reading a cycle's weights, not copies."""
    from accelgen.models import load_model

    shared_cycle.save(tiny(), tokenizer, tmp_path)
    model, _ = load_model(str(tmp_path), dtype="float32")
    assert shared_cycle.cycle_and_repeats(model, "speed") == (2, 3)
    assert model.model.layers[2].mlp.up_proj.weight is model.model.layers[0].mlp.up_proj.weight


def test_models_without_a_cycle_are_refused_by_name(make_tiny_model):
    plain = make_tiny_model("llama", layers=4)
    with pytest.raises(ValueError, match="speed needs a model whose decoder layers share weights in a cycle"):
        shared_cycle.cycle_and_repeats(plain, "speed")
    assert shared_cycle.tie_if_declared(plain) is plain  # nothing declared: left as it is
    plain.config.shared_cycle = 3  # 4 layers are no repeats of 3
    with pytest.raises(ValueError, match="does not divide the model's 4 layers"):
        shared_cycle.tie(plain)
    plain.config.shared_cycle = 2  # declared, but the copies differ: tying would change the model
    with pytest.raises(ValueError, match="layer 2's .* differs from layer 0's"):
        shared_cycle.tie(plain)


def test_a_cycle_needs_two_repeats():
    with pytest.raises(ValueError, match="repeats >= 2"):
        tiny(repeats=1)
