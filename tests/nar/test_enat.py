"""ENAT: the phrase table is each source token's most often aligned target token; the decoder reads the translated
tokens' embeddings (or the mapped source embeddings) in uniform-copy order, in one unmasked pass; the embedding
map's alignment loss is the squared distance to each aligned target embedding and falls in training; both variants
learn, save and load; bad options and an unfitted table are refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from accelgen.nar.enat import ENATModel, fit_lexical_table, target_alignment, word_alignment_loss
from accelgen.nar.nat import NATModel, noisy_parallel_decode, uniform_positions
from accelgen.nar.tokens import pad_sequences
from accelgen.nar.train import TrainSettings, train_model

VARIANTS = ["phrase-table", "embedding-map"]
_PHRASE_TABLE_MODEL: dict[str, ENATModel] = {}  # the trained phrase-table model, once per session


@pytest.fixture
def trained_enat(copy_task, seeded, trained, tiny_config):
    """trained_enat(decoder_inputs): a tiny ENAT trained 60 steps on the copy task. The shared `trained` fixture
    trains the embedding map; the phrase-table model needs its table fitted on the training rows first."""

    def get(decoder_inputs: str) -> ENATModel:
        if decoder_inputs == "embedding-map":
            return trained(ENATModel, 60, decoder_inputs="embedding-map")
        if "model" not in _PHRASE_TABLE_MODEL:
            model = seeded(ENATModel, tiny_config(), decoder_inputs="phrase-table")
            model.fit_phrase_table(copy_task[1])
            train_model(model, copy_task[1], TrainSettings(steps=60, batch_size=32, learning_rate=3e-3))
            _PHRASE_TABLE_MODEL["model"] = model
        return _PHRASE_TABLE_MODEL["model"]

    return get


def test_the_phrase_table_is_the_most_often_aligned_target_token(tiny_config):
    src, src_mask = pad_sequences([[10, 11, 12], [10, 13], [14, 10, 15, 13], [14]])
    tgt, tgt_mask = pad_sequences([[20, 21], [21, 13], [22, 13, 22], [23, 23]])
    # by hand: a target token absent from the source goes to its uniform position (t + 1/2)·S/T, rounded down
    # (row 0: 0, 2; row 1: 0, 1; row 2: 0, 2, 3; row 3: 0, 0); a 13 goes to the source's 13 (row 1: 1; row 2: 3)
    alignment = target_alignment(src, src_mask, tgt, tgt_mask)
    assert alignment.tolist() == [[0, 2, 0], [0, 1, 0], [0, 3, 3], [0, 0, 0]]
    # aligned pairs: 10->20, 12->21 | 10->21, 13->13 | 14->22, 13->13, 13->22 | 14->23, 14->23
    expected = list(range(30))  # 11 and 15 are never aligned: they translate to themselves
    expected[10] = 20  # 20 and 21 once each: the lower id
    expected[12] = 21
    expected[13] = 13  # 13 twice, 22 once
    expected[14] = 23  # 23 twice beats the lower 22 once
    assert fit_lexical_table(src, src_mask, tgt, tgt_mask, vocab_size=30).tolist() == expected
    model = ENATModel(dataclasses.replace(tiny_config(), vocab_size=30), decoder_inputs="phrase-table")
    model.fit_phrase_table({"src": src, "src_mask": src_mask, "tgt": tgt, "tgt_mask": tgt_mask})
    assert model.phrase_table.tolist() == expected and "phrase_table" in model.state_dict()
    assert model.translate(torch.tensor([[10, 11, 14]])).tolist() == [[20, 11, 23]]
    with pytest.raises(ValueError, match="must lie in 0..29"):
        fit_lexical_table(src, src_mask, tgt + 10, tgt_mask, vocab_size=30)


@pytest.mark.parametrize("decoder_inputs", VARIANTS)
def test_the_decoder_reads_the_enhanced_embeddings_in_uniform_copy_order(decoder_inputs, seeded, tiny_config,
                                                                         copy_task, monkeypatch, assert_reordered):
    model = seeded(ENATModel, tiny_config(), decoder_inputs=decoder_inputs)
    if decoder_inputs == "phrase-table":
        model.fit_phrase_table(copy_task[1])
    rows = copy_task[2]
    src, src_mask = rows["src"][:6], rows["src_mask"][:6]
    passes = []
    decode = model.backbone.decode

    def recording(inputs, target_mask, memory, mask, attention_mask=None):
        passes.append((inputs, target_mask, attention_mask))
        return decode(inputs, target_mask, memory, mask, attention_mask)

    monkeypatch.setattr(model.backbone, "decode", recording)
    outputs = model.generate(src, src_mask)
    assert len(passes) == 1  # one parallel pass, every position seeing every other
    inputs, target_mask, attention_mask = passes[0]
    assert attention_mask is None
    memory = model.backbone.encode(src, src_mask)
    lengths = model.backbone.length_logits(memory, src_mask).argmax(-1) + 1
    assert [len(output) for output in outputs] == lengths.tolist() == target_mask.sum(dim=1).tolist()
    translated_somewhere = False
    for row in range(6):
        source = src[row][src_mask[row]].tolist()
        order = uniform_positions(len(source), int(lengths[row]))  # the source position each target position reads
        if decoder_inputs == "phrase-table":
            table = model.phrase_table.tolist()
            translation = [table[token] for token in source]  # by hand, token by token
            translated_somewhere |= translation != source
            expected = model.backbone.embed_tokens(torch.tensor([translation[position] for position in order]))
            assert torch.equal(inputs[row, :len(order)], expected)
        else:
            embeddings = model.backbone.embed_tokens(torch.tensor([source[position] for position in order]))
            assert_reordered(inputs[row, :len(order)], embeddings @ model.source_map.weight.T)
    if decoder_inputs == "phrase-table":
        assert translated_somewhere  # the table changes tokens: this is not the plain uniform copy


def test_the_alignment_loss_is_the_squared_distance_to_each_aligned_target_embedding():
    generator = torch.Generator().manual_seed(0)
    mapped, goal = torch.randn(2, 4, 3, generator=generator), torch.randn(2, 3, 3, generator=generator)
    alignment = torch.tensor([[3, 0, 0], [1, 2, 0]])
    target_mask = torch.tensor([[True, True, True], [True, False, False]])
    by_hand = [sum((float(mapped[row, alignment[row, t], k]) - float(goal[row, t, k])) ** 2 for k in range(3)) / 3
               for row, t in [(0, 0), (0, 1), (0, 2), (1, 0)]]
    loss = word_alignment_loss(mapped, alignment, goal, target_mask)
    assert abs(float(loss) - sum(by_hand) / 4) < 1e-5


def test_the_alignment_loss_falls_in_training_and_trains_the_map(trained_enat, seeded, tiny_config, copy_task):
    held_out = copy_task[2]
    untrained, model = seeded(ENATModel, tiny_config()), trained_enat("embedding-map")

    def alignment_loss(enat: ENATModel) -> float:
        batch = enat.training_inputs(held_out, torch.Generator())
        with torch.no_grad():
            return enat.loss(batch)[1]["alignment_loss"]

    before, after = alignment_loss(untrained), alignment_loss(model)
    assert after < 0.5 * before, (before, after)
    assert not torch.equal(untrained.source_map.weight, model.source_map.weight)
    # alignment_weight scales the alignment term of the loss, and only it
    batch = model.training_inputs(held_out, torch.Generator())
    with torch.no_grad():
        losses = {weight: model_with_weight(model, weight).loss(batch) for weight in (0.0, 1.0, 2.5)}
    alignment = losses[0.0][1]["alignment_loss"]
    assert float(losses[0.0][0]) == pytest.approx(losses[0.0][1]["token_loss"] + losses[0.0][1]["length_loss"])
    assert float(losses[2.5][0] - losses[0.0][0]) == pytest.approx(2.5 * alignment, rel=1e-5)
    assert float(losses[1.0][0] - losses[0.0][0]) == pytest.approx(alignment, rel=1e-5)


def model_with_weight(model: ENATModel, weight: float) -> ENATModel:
    """A copy of model's weights under another alignment_weight."""
    copy = ENATModel(model.config, alignment_weight=weight).eval()
    copy.load_state_dict(model.state_dict())
    return copy


@pytest.mark.parametrize("decoder_inputs", VARIANTS)
def test_training_lowers_the_held_out_loss(decoder_inputs, seeded, tiny_config, copy_task):
    _, rows, held_out, _ = copy_task
    model = seeded(ENATModel, tiny_config(dropout=0.1), decoder_inputs=decoder_inputs)
    if decoder_inputs == "phrase-table":
        model.fit_phrase_table(rows)
    result = train_model(model, rows, TrainSettings(steps=30, batch_size=32, learning_rate=3e-3, eval_every=15),
                         held_out=held_out)
    steps, losses = zip(*result["held_out"])
    assert steps == (0, 15, 30)
    assert losses[2] < 0.6 * losses[0], losses


@pytest.mark.parametrize("decoder_inputs", VARIANTS)
def test_save_and_load_give_the_same_outputs(decoder_inputs, trained_enat, copy_task, tmp_path):
    model = trained_enat(decoder_inputs)
    rows = copy_task[2]
    outputs = model.generate(rows["src"], rows["src_mask"])
    assert len({tuple(output) for output in outputs}) > 10  # trained: different sources, different outputs
    model.save(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["method"] == "enat" and saved["options"] == model.options()
    loaded = ENATModel.load(tmp_path)
    assert loaded.options() == model.options()
    assert loaded.generate(rows["src"], rows["src_mask"]) == outputs
    if decoder_inputs == "phrase-table":  # the table travels with the weights
        assert torch.equal(loaded.phrase_table, model.phrase_table)
    with pytest.raises(ValueError, match="not a 'nat' one"):
        NATModel.load(tmp_path)


def test_an_ar_teacher_can_rescore_length_candidates(trained_enat, copy_task):
    """ENAT is a NAT with uniform copy: nat.noisy_parallel_decode decodes its sampled lengths in one pass and
    returns the candidate the scorer prefers (the paper's teacher rescoring, over sampled lengths)."""
    model = trained_enat("phrase-table")
    rows = copy_task[2]
    src, src_mask = rows["src"][:4], rows["src_mask"][:4]

    def longest(src_ids, mask, candidates, candidate_mask):
        return candidate_mask.sum(dim=1).float()

    result = noisy_parallel_decode(model, src, src_mask, longest, samples=5, temperature=3.0,
                                   generator=torch.Generator().manual_seed(0))
    for row in range(4):
        assert result.candidates[row][0] == model.generate(src[row:row + 1], src_mask[row:row + 1])[0]
        assert len(result.sequences[row]) == max(len(candidate) for candidate in result.candidates[row])
    assert len({len(candidate) for candidates in result.candidates for candidate in candidates}) > 1  # sampled


def test_bad_options_and_an_unfitted_table_are_refused(tiny_config, copy_task):
    config = tiny_config()
    with pytest.raises(ValueError, match="decoder_inputs must be one of"):
        ENATModel(config, decoder_inputs="fertility")
    with pytest.raises(ValueError, match="embedding-map'? only"):
        ENATModel(config, decoder_inputs="phrase-table", alignment_weight=1.0)
    for weight in (-1.0, float("nan"), "1", True):
        with pytest.raises(ValueError, match="alignment_weight must be"):
            ENATModel(config, alignment_weight=weight)
    with pytest.raises(ValueError, match="only decoder_inputs='phrase-table' has a phrase table"):
        ENATModel(config).fit_phrase_table(copy_task[1])
    unfitted = ENATModel(config, decoder_inputs="phrase-table")
    rows = copy_task[2]
    with pytest.raises(ValueError, match="call model.fit_phrase_table"):
        unfitted.generate(rows["src"][:2], rows["src_mask"][:2])
    with pytest.raises(ValueError, match="call model.fit_phrase_table"):
        unfitted.loss(unfitted.training_inputs(rows, torch.Generator()))
    embedding_map = ENATModel(config)
    with pytest.raises(ValueError, match="needs its 'alignment'"):
        embedding_map.loss(rows)
