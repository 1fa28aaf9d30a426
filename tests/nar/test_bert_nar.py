"""BERT-NAR (Su et al. 2021): ratio-first slot counts are ceil(α·S) clipped, α the ratio giving the fewest slots
that cover the training rows; training slots hold the target, then EOS; the context-aware unlikelihood term equals a
brute-force sum; generate is one decoder pass over MASK slots cut at the first EOS; training lowers the held-out
loss; a saved model decodes the same; a backbone starts from another method's; bad options are refused."""

from __future__ import annotations

import math

import pytest
import sacrebleu
import torch

from accelgen.nar.backbone import masked_cross_entropy
from accelgen.nar.bert_nar import BertNARModel, context_unlikelihood, covering_ratio, slot_counts, slot_targets
from accelgen.nar.mask_predict import CMLMModel
from accelgen.nar.tokens import EOS, MASK, PAD, pad_sequences
from accelgen.nar.train import TrainSettings, train_model


@pytest.fixture(scope="module")
def ratio(copy_task):
    """α fitted on the copy task's training rows (summaries of 2-6 tokens, sources of 7-10)."""
    rows = copy_task[1]
    return covering_ratio(rows["src_mask"].sum(dim=1), rows["tgt_mask"].sum(dim=1))


@pytest.fixture(scope="module")
def model(trained, ratio):
    return trained(BertNARModel, 60, length_ratio=ratio)


def test_ratio_first_slots_are_ceil_alpha_times_the_source_length_clipped():
    lengths = torch.tensor([1, 7, 10, 18, 19, 40])
    assert slot_counts(lengths, 0.7, max_slots=13).tolist() == [1, 5, 7, 13, 13, 13]  # 0.7, 4.9, 7.0, 12.6, 13.3, 28
    assert slot_counts(lengths, 0.7, max_slots=6).tolist() == [1, 5, 6, 6, 6, 6]
    # a ratio fitted as (L + 1) / S gives that source exactly L + 1 slots, though (7 / 25) · 25 is 7.000000000000001
    assert slot_counts(torch.tensor([25, 26, 3]), 7 / 25, max_slots=13).tolist() == [7, 8, 1]


def test_the_fitted_ratio_gives_the_fewest_slots_that_cover_the_rows(copy_task, seeded, tiny_config):
    sources, targets = torch.tensor([10, 4, 5, 8]), torch.tensor([3, 1, 4, 1])  # L / S: 0.3, 0.25, 0.8, 0.125
    # all rows: α above 0.8 (5 slots for the 5 tokens); 7/8 is the largest ratio giving each length what 0.8+ gives
    expected = {1.0: 7 / 8, 0.75: 3 / 8, 0.5: 3 / 10, 0.25: 2 / 10, 0.1: 2 / 10}
    assert {coverage: covering_ratio(sources, targets, coverage) for coverage in expected} == \
        pytest.approx(expected, rel=1e-12)
    assert slot_counts(sources, 7 / 8, 13).tolist() == [9, 4, 5, 7] and slot_counts(sources, 0.8, 13)[2] == 4
    alpha = covering_ratio(torch.tensor([22]), torch.tensor([15]))  # though (15 / 22) · 22 is 14.999999999999998
    assert alpha == pytest.approx(16 / 22) and slot_counts(torch.tensor([22]), alpha, 30).tolist() == [16]
    rows = copy_task[1]
    sources, targets = rows["src_mask"].sum(dim=1), rows["tgt_mask"].sum(dim=1)

    def covered(alpha: float) -> float:  # the share of rows whose slots hold the target and its EOS
        return float((slot_counts(sources, alpha, 13) >= targets + 1).float().mean())

    # slot counts change just after each j / s: the largest ratio of each run of equal counts is one of them
    ends = sorted({slots / length for length in sources.unique().tolist() for slots in range(1, 14)})
    for coverage in (1.0, 0.9, 0.5):
        smallest = next(alpha for alpha in ends if covered(alpha) >= coverage)  # brute force
        alpha = covering_ratio(sources, targets, coverage)
        assert alpha == pytest.approx(smallest, rel=1e-12) and covered(alpha) >= coverage
        assert torch.equal(slot_counts(sources, alpha, 13), slot_counts(sources, smallest, 13))
    assert covering_ratio(sources, targets) == pytest.approx(5 / 8)  # L / S at most 6/10; 7-10 tokens
    model = seeded(BertNARModel, tiny_config())
    assert model.fit_length_ratio(rows, coverage=0.9) == covering_ratio(sources, targets, 0.9)
    assert model.options()["length_ratio"] == covering_ratio(sources, targets, 0.9) < 5 / 8


def test_training_slots_hold_the_target_then_eos_and_never_cut_it(seeded, tiny_config, copy_task):
    tgt, tgt_mask = pad_sequences([[5, 6, 7], [8], [9, 10]])
    targets, slot_mask = slot_targets(tgt, tgt_mask, torch.tensor([4, 5, 3]))
    assert targets.tolist() == [[5, 6, 7, EOS, PAD],
                                [8, EOS, EOS, EOS, EOS],
                                [9, 10, EOS, PAD, PAD]]
    assert slot_mask.int().tolist() == [[1, 1, 1, 1, 0], [1] * 5, [1, 1, 1, 0, 0]]
    with pytest.raises(ValueError, match="one for its EOS"):
        slot_targets(tgt, tgt_mask, torch.tensor([3, 5, 3]))
    # a ratio too small for the targets: each row still trains on its whole target and EOS (L + 1 slots)
    model = seeded(BertNARModel, tiny_config(), length_ratio=0.01, context_window=0)
    rows = copy_task[2]
    batch = {name: tensor[:6] for name, tensor in rows.items()}
    loss, metrics = model.loss(batch)
    targets, slot_mask = slot_targets(batch["tgt"], batch["tgt_mask"], batch["tgt_mask"].sum(dim=1) + 1)
    memory = model.backbone.encode(batch["src"], batch["src_mask"])
    expected = masked_cross_entropy(model.slot_logits(memory, batch["src_mask"], slot_mask), targets, slot_mask)
    torch.testing.assert_close(loss, expected)
    assert set(metrics) == {"token_loss"}


@pytest.mark.parametrize("window", [0, 1, 2, 9])
def test_the_context_unlikelihood_is_the_brute_force_sum_over_neighbours(window):
    generator = torch.Generator().manual_seed(0)
    log_probs = (torch.randn(2, 6, 9, generator=generator) * 2).log_softmax(-1)
    targets = torch.tensor([[3, 4, 4, 5, EOS, EOS],
                            [6, 3, 6, EOS, PAD, PAD]])  # repeats: a neighbour of the same token is not penalised
    slot_mask = targets != PAD
    total = 0.0
    for row in range(2):
        for i in range(6):
            for j in range(6):
                if slot_mask[row, i] and slot_mask[row, j] and 0 < abs(i - j) <= window \
                        and targets[row, j] != targets[row, i]:
                    total -= math.log(1 - math.exp(float(log_probs[row, i, targets[row, j]])))
    expected = total / int(slot_mask.sum())
    assert float(context_unlikelihood(log_probs, targets, slot_mask, window)) == pytest.approx(expected, rel=1e-5)
    if window:
        assert expected > 0


def test_the_loss_adds_the_context_term(seeded, tiny_config, copy_task, ratio):
    batch = {name: tensor[:6] for name, tensor in copy_task[2].items()}
    plain = seeded(BertNARModel, tiny_config(), length_ratio=ratio, context_window=0)
    aware = seeded(BertNARModel, tiny_config(), length_ratio=ratio, context_window=2)
    plain_loss, _ = plain.loss(batch)
    aware_loss, metrics = aware.loss(batch)
    assert metrics["token_loss"] == pytest.approx(float(plain_loss.detach())) and metrics["context_loss"] > 0
    assert float(aware_loss.detach()) == pytest.approx(metrics["token_loss"] + metrics["context_loss"])


def test_one_pass_over_mask_slots_cut_at_the_first_eos(seeded, tiny_config, monkeypatch):
    """A fake decoder pass with hand-made logits: one call over all slots, no attention mask, MASK inputs; each
    row's output is its slots' argmaxes (never PAD, BOS, MASK or UNK) up to the first EOS or its last slot."""
    model = seeded(BertNARModel, tiny_config(), length_ratio=0.5)
    src, src_mask = pad_sequences([[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7]])  # 4 and 2 slots
    preferred = [[[10], [PAD, 13], [11], [EOS]],  # slot 1: PAD scores best but is never generated
                 [[14], [MASK, 15], [16], [17]]]  # slots 2-3 are not this row's: it ends before them
    calls = []

    def fake_pass(ids, target_mask, memory, src_mask, attention_mask=None):
        calls.append((ids.clone(), target_mask.clone(), attention_mask))
        logits = torch.zeros(*ids.shape, model.config.vocab_size)
        for row, slots in enumerate(preferred):
            for slot, tokens in enumerate(slots):
                for rank, token in enumerate(tokens):
                    logits[row, slot, token] = 10.0 - rank
        return logits

    monkeypatch.setattr(model.backbone, "decode_tokens", fake_pass)
    assert model.generate(src, src_mask) == [[10, 13, 11], [14, 15]]
    assert len(calls) == 1
    ids, target_mask, attention_mask = calls[0]
    assert attention_mask is None and (ids == MASK).all()
    assert target_mask.int().tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    preferred[0][3] = [12]  # no EOS at all: the whole row
    assert model.generate(src, src_mask)[0] == [10, 13, 11, 12]


def test_a_trained_model_decodes_in_one_pass_and_learns_the_copy_task(model, copy_task, monkeypatch):
    vocabulary, _, rows, pairs = copy_task
    passes = []
    decode = model.backbone.decode
    monkeypatch.setattr(model.backbone, "decode", lambda *args: passes.append(args[0].shape) or decode(*args))
    outputs = model.generate(rows["src"], rows["src_mask"])
    slots = model.slots(rows["src_mask"])
    assert passes == [(len(outputs), int(slots.max()), model.config.width)]  # every row, every slot, once
    assert all(EOS not in output and len(output) < int(count) for output, count in zip(outputs, slots))
    texts = [vocabulary.decode(output) for output in outputs]
    assert sacrebleu.corpus_bleu(texts, [[summary for _, summary in pairs]]).score > 60


def test_training_lowers_the_held_out_loss(seeded, tiny_config, copy_task, ratio):
    _, rows, held_out, _ = copy_task
    model = seeded(BertNARModel, tiny_config(dropout=0.1), length_ratio=ratio)
    result = train_model(model, rows, TrainSettings(steps=30, batch_size=32, learning_rate=3e-3, eval_every=15),
                         held_out=held_out)
    steps, losses = zip(*result["held_out"])
    assert steps == (0, 15, 30)
    assert losses[2] < 0.5 * losses[0], losses


def test_a_saved_model_loads_and_decodes_the_same(model, copy_task, tmp_path):
    rows = copy_task[2]
    loaded = BertNARModel.load(model.save(tmp_path / "bert-nar"))
    assert loaded.options() == model.options() == {"length_ratio": model.length_ratio, "context_window": 2}
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert loaded.generate(rows["src"], rows["src_mask"]) == model.generate(rows["src"], rows["src_mask"])


def test_the_backbone_starts_from_another_methods_model(trained, seeded, tiny_config, ratio, tmp_path):
    source = trained(CMLMModel, 60)
    source.save(tmp_path / "cmlm")
    model = seeded(BertNARModel, tiny_config(dropout=0.2), length_ratio=ratio)  # dropout may differ
    assert model.init_backbone_from(tmp_path / "cmlm") is model
    for name, tensor in source.backbone.state_dict().items():
        assert torch.equal(tensor, model.backbone.state_dict()[name]), name
    seeded(CMLMModel, tiny_config(width=32)).save(tmp_path / "narrow")
    with pytest.raises(ValueError, match="does not have this model's sizes"):
        model.init_backbone_from(tmp_path / "narrow")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not a model folder"):
        model.init_backbone_from(tmp_path / "empty")


def test_bad_options_and_inputs_are_refused(seeded, tiny_config, copy_task):
    for length_ratio in (0, -0.5, float("nan"), float("inf"), "0.5", True):
        with pytest.raises(ValueError, match="length_ratio must be a positive number"):
            BertNARModel(tiny_config(), length_ratio=length_ratio)
    for window in (-1, 1.5, True):
        with pytest.raises(ValueError, match="context_window must be an integer"):
            BertNARModel(tiny_config(), context_window=window)
    unfitted = seeded(BertNARModel, tiny_config())
    rows = copy_task[2]
    with pytest.raises(ValueError, match="fit_length_ratio"):
        unfitted.generate(rows["src"][:2], rows["src_mask"][:2])
    with pytest.raises(ValueError, match="fit_length_ratio"):
        unfitted.loss({name: tensor[:2] for name, tensor in rows.items()})
    for coverage in (0, 1.5):
        with pytest.raises(ValueError, match="coverage must be in"):
            covering_ratio(torch.tensor([5]), torch.tensor([2]), coverage)
    with pytest.raises(ValueError, match="a source and a target each"):
        covering_ratio(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="at least one token"):
        covering_ratio(torch.tensor([0, 3]), torch.tensor([1, 1]))
