"""MPEE heads: untrained exits are the plain ones, upper exits read the lower exits' features, save/load round-trips,
and heads for another model are refused by name."""

import pytest
import torch

from accelgen.heads.mpee import MpeeHeads, embedding_fingerprint


@pytest.fixture(scope="module")
def four_layers(make_tiny_model):
    return make_tiny_model("qwen2", seed=0, layers=4)


def trained_looking(heads: MpeeHeads, seed: int = 3) -> MpeeHeads:
    """Heads with every weight random (the adapters too, which start at zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return heads


def test_an_untrained_exit_is_the_plain_exit(four_layers):
    heads = MpeeHeads.for_model(four_layers, [0, 2], rank=8)
    hidden = {0: torch.randn(5, 64), 2: torch.randn(5, 64)}
    features = heads.chain(hidden)
    assert features[2].shape == (5, 8)
    torch.testing.assert_close(heads.adapt(2, hidden[2], features[2]), hidden[2], rtol=0, atol=0)
    confidence = heads.confidence(2, features[2])
    assert confidence.shape == (5,) and bool(((confidence > 0) & (confidence < 1)).all())


def test_an_upper_exit_reads_the_lower_exits_features(four_layers):
    heads = trained_looking(MpeeHeads.for_model(four_layers, [0, 1, 2], rank=8))
    hidden = {layer: torch.randn(3, 64) for layer in (0, 1, 2)}
    moved = {**hidden, 0: hidden[0] + 1.0}  # only the lowest exit's state changes
    before, after = heads.chain(hidden), heads.chain(moved)
    assert not torch.allclose(before[2], after[2])  # ... and the top exit's features move with it
    assert heads.below(0) is None and heads.below(2) == 1
    with pytest.raises(ValueError, match="needs the features of exit 0"):
        heads.features(1, hidden[1], None)


def test_saved_heads_load_the_same(four_layers, tmp_path):
    heads = trained_looking(MpeeHeads.for_model(four_layers, [0, 2], rank=8))
    heads.save(tmp_path)
    loaded = MpeeHeads.load(tmp_path, four_layers)
    assert loaded.layers == [0, 2] and loaded.fingerprint == embedding_fingerprint(four_layers)
    hidden = {0: torch.randn(4, 64), 2: torch.randn(4, 64)}
    torch.testing.assert_close(loaded.chain(hidden)[2], heads.chain(hidden)[2])


def test_heads_for_another_shape_are_refused(four_layers, make_tiny_model, tmp_path):
    MpeeHeads.for_model(four_layers, [0, 2], rank=8).save(tmp_path)
    with pytest.raises(ValueError, match="do not fit this model: layer count 4, the model's is 2"):
        MpeeHeads.load(tmp_path, make_tiny_model("qwen2", seed=0, layers=2))


def test_heads_for_other_weights_of_the_same_shape_are_refused(four_layers, make_tiny_model, tmp_path):
    MpeeHeads.for_model(four_layers, [0, 2], rank=8).save(tmp_path)
    other = make_tiny_model("qwen2", seed=5, layers=4)
    with pytest.raises(ValueError, match="weights differ from this model's.*accelgen train mpee"):
        MpeeHeads.load(tmp_path, other)


def test_missing_heads_name_the_command_that_trains_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="accelgen train mpee --out"):
        MpeeHeads.load(tmp_path / "nowhere")


def test_exit_layers_must_be_distinct():
    with pytest.raises(ValueError, match="distinct exit layers"):
        MpeeHeads([1, 1], 64, 8)
