"""The shared encoder-decoder: padding is invisible, the decoder is causal or parallel as asked, lengths come from
the pooled source; folders save and load only as the method that made them, and inputs too long are refused."""

from __future__ import annotations

import json

import pytest
import torch

from accelgen.nar.ar import ARStudent
from accelgen.nar.backbone import BackboneConfig, Seq2SeqBackbone, causal_mask
from accelgen.nar.mask_predict import CMLMModel
from accelgen.nar.nat import NATModel
from accelgen.nar.sat import SATModel
from accelgen.nar.tokens import PAD


def test_padding_changes_nothing_and_the_decoder_is_causal_only_when_asked(tiny_config, assert_reordered):
    torch.manual_seed(0)
    backbone = Seq2SeqBackbone(tiny_config()).eval()
    src = torch.tensor([[5, 6, 7, PAD, PAD]])
    mask = src != PAD
    memory = backbone.encode(src, mask)
    assert_reordered(memory[:, :3], backbone.encode(src[:, :3], mask[:, :3]))
    assert_reordered(backbone.length_logits(memory, mask), backbone.length_logits(memory[:, :3], mask[:, :3]))

    target = torch.tensor([[8, 9, 10, 11]])
    changed = torch.tensor([[8, 9, 10, 12]])  # only the last token differs
    everywhere = torch.ones_like(target, dtype=torch.bool)
    causal = [backbone.decode_tokens(ids, everywhere, memory, mask, causal_mask(4)) for ids in (target, changed)]
    assert_reordered(causal[0][:, :3], causal[1][:, :3])  # earlier positions cannot see the last one
    parallel = [backbone.decode_tokens(ids, everywhere, memory, mask) for ids in (target, changed)]
    assert (parallel[0][:, 0] - parallel[1][:, 0]).abs().max() > 1e-3  # without a mask, position 0 sees it
    assert backbone.length_logits(memory, mask).shape == (1, tiny_config().max_target_len)


def test_config_sizes_are_checked():
    with pytest.raises(ValueError, match="not a multiple of heads"):
        BackboneConfig(vocab_size=10, width=30, heads=4)
    with pytest.raises(ValueError, match="must be positive"):
        BackboneConfig(vocab_size=10, decoder_layers=0)


@pytest.mark.parametrize("cls, options", [(ARStudent, {}), (NATModel, {"decoder_inputs": "uniform"}),
                                          (NATModel, {"max_fertility": 3}), (CMLMModel, {}),
                                          (SATModel, {"group_size": 3})])
def test_a_saved_model_loads_back_as_its_method(cls, options, tiny_config, seeded, copy_task, tmp_path):
    model = seeded(cls, tiny_config(), **options)
    model.save(tmp_path / "model")
    saved = json.loads((tmp_path / "model" / "config.json").read_text())
    assert (saved["kind"], saved["method"], saved["options"]) == ("accelgen-nar", cls.method, model.options())
    loaded = cls.load(tmp_path / "model")
    assert loaded.options() == model.options() and loaded.config == model.config and not loaded.training
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    src, src_mask = copy_task[2]["src"][:3], copy_task[2]["src_mask"][:3]
    assert loaded.generate(src, src_mask) == model.generate(src, src_mask)


def test_a_folder_of_another_kind_is_refused_with_the_reason(tiny_config, seeded, tmp_path):
    seeded(NATModel, tiny_config()).save(tmp_path / "nat")
    with pytest.raises(ValueError, match="holds a 'nat' model, not a 'mask-predict' one"):
        CMLMModel.load(tmp_path / "nat")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="holds a 'llama' model, not an accelgen NAR model"):
        ARStudent.load(tmp_path / "llama")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not a model folder: it has no config.json"):
        ARStudent.load(tmp_path / "empty")
    small = tiny_config(width=32)
    seeded(ARStudent, small).save(tmp_path / "mixed")
    torch.manual_seed(1)
    ARStudent(tiny_config()).save(tmp_path / "other")
    (tmp_path / "other" / "config.json").replace(tmp_path / "mixed" / "config.json")  # weights of another size
    with pytest.raises(ValueError, match="do not fit its config.json"):
        ARStudent.load(tmp_path / "mixed")


def test_an_input_longer_than_the_encoder_is_refused(tiny_config, seeded):
    model = seeded(ARStudent, tiny_config(max_source_len=8))
    src = torch.full((1, 9), 5)
    with pytest.raises(ValueError, match="the input has 9 tokens but this encoder reads at most 8"):
        model.generate(src, src != PAD)
    assert len(model.generate(src[:, :8], src[:, :8] != PAD)) == 1
