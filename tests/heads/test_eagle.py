"""The EAGLE head: untrained, it passes the target's feature through (training starts from there)."""

import torch

from accelgen.heads.eagle import new_head
from accelgen.train.eagle import collect_features, whole_windows


def test_an_untrained_head_passes_the_feature_through(tiny_target, tiny_target_windows):
    windows = tiny_target_windows[:2]
    features, _ = collect_features(tiny_target, windows)
    head = new_head(tiny_target)
    output = head(tiny_target.get_input_embeddings()(windows), features, *whole_windows(windows.shape[1]))
    assert torch.allclose(output, features, atol=1e-5)


# --- the EAGLE-3 head ----------------------------------------------------------------------------------------

import json

import pytest

from accelgen.heads.eagle import EagleHead
from accelgen.heads.eagle3 import Eagle3Head, default_target_layers, new_eagle3_head
from accelgen.train.eagle import collect_layer_states


def test_the_default_layers_are_vllms_for_a_deep_model_and_in_range_for_a_shallow_one():
    assert default_target_layers(30) == (2, 15, 27)  # vLLM: (2, L // 2, L - 3)
    assert default_target_layers(2) == (1, 1, 1) and default_target_layers(4) == (1, 2, 3)


def test_an_untrained_eagle3_head_reads_its_highest_layer_through_the_targets_norm_and_lm_head(make_tiny_model):
    """Its start: fc passes the highest read layer's state, the layer adds nothing, and the norm and the draft
    vocabulary's LM head rows are the target's (the "logit lens" there)."""
    model = make_tiny_model("qwen2", seed=0, layers=4)
    windows = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    vocab = torch.arange(0, 49152, 5)
    head = new_eagle3_head(model, vocab)
    states, _ = collect_layer_states(model, windows, head.target_layers)
    output = head(model.get_input_embeddings()(windows), head.fuse(states), *whole_windows(windows.shape[1]))
    high = states[..., 2 * 64:]  # the last of the three layers (width 64)
    assert torch.allclose(output, high, atol=1e-5)
    lens = model.get_output_embeddings()(model.model.norm(high))[..., vocab]
    assert torch.allclose(head.draft_logits(output), lens, atol=1e-4)
    full = head.vocab_logits(output)
    assert torch.equal(full[..., vocab], head.draft_logits(output)) and torch.isinf(full[..., 1]).all()


def test_the_draft_vocabulary_maps_both_ways(make_tiny_model):
    model = make_tiny_model("qwen2", seed=0, layers=4)
    vocab = torch.tensor([3, 7, 8, 100, 49151])
    head = new_eagle3_head(model, vocab)
    assert torch.equal(torch.arange(5) + head.d2t, vocab) and torch.equal(head.draft_ids, vocab)  # d2t: offsets
    assert int(head.t2d.sum()) == 5 and bool(head.t2d[vocab].all())
    assert head.label_index(torch.tensor([7, 9, 49151])).tolist() == [1, -100, 4]


def test_eagle_head_load_returns_the_recipe_saved_and_refuses_a_head_that_does_not_fit(make_tiny_model, tmp_path):
    model = make_tiny_model("qwen2", seed=0, layers=4)
    head = new_eagle3_head(model, torch.arange(100))
    head.save(tmp_path)
    assert json.loads((tmp_path / "eagle_head.json").read_text())["recipe"] == "eagle3"
    loaded = EagleHead.load(tmp_path, model)
    assert isinstance(loaded, Eagle3Head) and loaded.target_layers == (1, 2, 3)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), head.state_dict().values()))
    with pytest.raises(ValueError, match="eagle head .* do not fit this model: layer count 4, the model's is 2"):
        EagleHead.load(tmp_path, make_tiny_model("qwen2", seed=0, layers=2))
    config = json.loads((tmp_path / "eagle_head.json").read_text())
    (tmp_path / "eagle_head.json").write_text(json.dumps({**config, "recipe": "eagle9"}))
    with pytest.raises(ValueError, match="names the recipe 'eagle9'; accelgen knows eagle1, eagle3"):
        EagleHead.load(tmp_path, model)
