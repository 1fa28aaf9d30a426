"""Trained heads on disk: each kind's file names, config keys and tensor names are pinned (heads trained by an
earlier version must go on loading), a saved head loads back as it was, and one that does not fit a model, or is
not there, is refused by name."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from accelgen.heads.eagle import EagleHead, new_head
from accelgen.heads.exit_heads import ExitHeads
from accelgen.heads.medusa import MedusaHeads
from accelgen.heads.pass_embeddings import LookaheadEmbeddings

LAYER = ["layer.mlp.down_proj.weight", "layer.mlp.gate_proj.weight", "layer.mlp.up_proj.weight",
         "layer.post_attention_layernorm.weight", "layer.self_attn.k_proj.weight", "layer.self_attn.o_proj.weight",
         "layer.self_attn.q_proj.weight", "layer.self_attn.v_proj.weight"]
# kind -> (a head of it for the tiny qwen2 target, its file name, its config's keys, its tensors' names)
FORMATS = {
    "eagle": (new_head, "eagle_head", ["base_model", "config", "draft_vocab", "layer_count"],
              ["fc.weight", *LAYER, "vocab"]),
    "medusa": (lambda model: MedusaHeads(2, 64, 49152, "tiny", 2, draft_vocab=3), "medusa_heads",
               ["base_model", "draft_vocab", "heads", "hidden_size", "layer_count", "vocab_size"],
               ["blocks.0.bias", "blocks.0.weight", "blocks.1.bias", "blocks.1.weight", "vocab"]),
    "pass": (lambda model: LookaheadEmbeddings(3, 64, 49152, "tiny", 2), "pass_embeddings",
             ["base_model", "count", "hidden_size", "layer_count", "vocab_size"], ["vectors"]),
    "exit": (lambda model: ExitHeads([1], 64, 8, "tiny", 49152, 2), "exit_heads",
             ["base_model", "hidden_size", "layer_count", "layers", "rank", "vocab_size"],
             ["adapters.1.0.weight", "adapters.1.2.weight", "classifiers.1.bias", "classifiers.1.weight"]),
}


def randomized(module: torch.nn.Module) -> torch.nn.Module:
    """module with every floating-point weight random, so that a load that dropped one would show."""
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn_like(parameter))
    return module


@pytest.mark.parametrize("kind", FORMATS)
def test_each_kind_is_saved_in_its_pinned_layout_and_loads_back_as_it_was(kind, tiny_target, tmp_path):
    build, name, config_keys, tensor_names = FORMATS[kind]
    head = randomized(build(tiny_target))
    head.save(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"{name}.json", f"{name}.safetensors"]
    assert sorted(json.loads((tmp_path / f"{name}.json").read_text())) == config_keys
    assert sorted(load_file(tmp_path / f"{name}.safetensors")) == tensor_names
    loaded = type(head).load(tmp_path, tiny_target)
    for key, value in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)


def test_heads_written_by_hand_in_the_saved_layout_load(tiny_target, tmp_path):
    """What an earlier version wrote: the config as JSON, the weights by their state-dict names."""
    (tmp_path / "medusa_heads.json").write_text(json.dumps({"heads": 1, "base_model": "tiny", "hidden_size": 64,
                                                            "layer_count": 2, "vocab_size": 49152, "draft_vocab": 2}))
    weights = {"blocks.0.weight": torch.eye(64), "blocks.0.bias": torch.ones(64), "vocab": torch.tensor([3, 9])}
    save_file(weights, tmp_path / "medusa_heads.safetensors")
    heads = MedusaHeads.load(tmp_path, tiny_target)
    assert (len(heads), heads.base_model, heads.vocab.tolist()) == (1, "tiny", [3, 9])
    torch.testing.assert_close(heads.blocks[0].weight, torch.eye(64))


def test_a_head_for_another_shape_or_none_at_all_is_refused_by_name(tiny_target, make_tiny_model, tmp_path):
    LookaheadEmbeddings(3, 64, 49152, "tiny", 2).save(tmp_path)
    with pytest.raises(ValueError, match="these pass embeddings .trained for tiny. do not fit this model: "
                                         "layer count 2, the model's is 3"):
        LookaheadEmbeddings.load(tmp_path, make_tiny_model("qwen2", layers=3))
    with pytest.raises(FileNotFoundError, match="no eagle head in .* `accelgen train eagle --out"):
        EagleHead.load(tmp_path / "nothing", tiny_target)
