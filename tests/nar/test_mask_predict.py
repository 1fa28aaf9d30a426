"""Mask-Predict: training masks 1..N random target tokens; decoding re-masks exactly the n = N·(T−t)/T tokens of
lowest confidence each iteration, keeps the others' tokens and probabilities, and picks the length candidate of
best average log-probability."""

from __future__ import annotations

import pytest
import torch

from accelgen.nar import mask_predict as cmlm
from accelgen.nar.mask_predict import CMLMModel, lowest_confidence_positions, mask_predict, remask_count
from accelgen.nar.tokens import MASK, pad_sequences


def test_the_lowest_confidence_positions_are_chosen_never_padding():
    confidence = torch.tensor([[0.9, 0.1, 0.5, 0.3, 0.05],
                               [0.2, 0.2, 0.8, 0.1, 0.7]])
    target_mask = torch.tensor([[True, True, True, True, False],  # 0.05 is padding: never re-masked
                                [True] * 5])
    chosen = lowest_confidence_positions(confidence, target_mask, torch.tensor([2, 3]))
    assert chosen.int().tolist() == [[0, 1, 0, 1, 0],
                                     [1, 1, 0, 1, 0]]  # the tie at 0.2: both in
    tie = lowest_confidence_positions(confidence[1:], target_mask[1:], torch.tensor([2]))
    assert tie.int().tolist() == [[1, 0, 0, 1, 0]]  # 0.1, then the earlier 0.2
    everything = lowest_confidence_positions(confidence, target_mask, torch.tensor([9, 0]))
    assert everything.tolist() == [target_mask[0].tolist(), [False] * 5]


def test_each_iteration_remasks_n_equal_to_n_times_t_minus_t_over_t():
    assert remask_count(torch.tensor([10, 3]), 1, 4).tolist() == [7, 2]
    assert [int(remask_count(torch.tensor(10), t, 4)) for t in range(1, 4)] == [7, 5, 2]


def test_decoding_remasks_exactly_the_lowest_confidence_tokens(seeded, tiny_config, monkeypatch):
    """A fake pass with hand-made (random) tokens and probabilities: at each iteration, the MASKed positions of its
    input must be the n lowest-probability tokens of what it returned so far, the others unchanged."""
    model = seeded(CMLMModel, tiny_config())
    monkeypatch.setattr(model.backbone, "length_logits",
                        lambda memory, src_mask: torch.tensor([[0.0, 0.0, 0.0, 0.0, 9.0, 0.0, 5.0]]))  # 5, then 7
    generator = torch.Generator().manual_seed(0)
    passes = []  # (its input tokens, the tokens it predicted, their log-probs)

    def fake_pass(model, tokens, target_mask, memory, src_mask):
        predicted = torch.randint(10, 40, tokens.shape, generator=generator)
        log_probs = (torch.rand(tokens.shape, generator=generator) * 0.9 + 0.05).log()
        passes.append((tokens.clone(), predicted, log_probs))
        return predicted, log_probs

    monkeypatch.setattr(cmlm, "predict_masked", fake_pass)
    iterations = 4
    src = torch.tensor([[5, 6, 7]])
    output = mask_predict(model, src, src > 0, iterations=iterations, length_candidates=2)
    assert len(passes) == iterations
    lengths = torch.tensor([5, 7])
    target_mask = torch.arange(7) < lengths.unsqueeze(1)
    tokens, confidence = torch.full((2, 7), MASK), torch.zeros(2, 7)
    for iteration, (inputs, predicted, log_probs) in enumerate(passes):
        masked = (inputs == MASK) & target_mask
        if iteration == 0:
            assert torch.equal(masked, target_mask)  # everything is unknown at first
        else:
            assert masked.sum(dim=1).tolist() == (lengths * (iterations - iteration) // iterations).tolist()
            for row in range(2):  # the masked ones are the least confident real positions
                kept = target_mask[row] & ~masked[row]
                assert confidence[row][masked[row]].max() <= confidence[row][kept].min()
            assert torch.equal(inputs[target_mask & ~masked], tokens[target_mask & ~masked])  # the rest keep theirs
        tokens = torch.where(masked, predicted, tokens)
        confidence = torch.where(masked, log_probs, confidence)
    average = (confidence * target_mask).sum(dim=1) / lengths
    best = int(average.argmax())
    assert output == [tokens[best][target_mask[best]].tolist()]


def test_an_iteration_that_remasks_nothing_costs_no_pass(seeded, tiny_config, monkeypatch):
    """N = 3, T = 10: t = 7, 8, 9 re-mask 3·(10−t)/10 = 0 tokens, so 7 passes, and the output is the last pass's."""
    model = seeded(CMLMModel, tiny_config())
    monkeypatch.setattr(model.backbone, "length_logits",
                        lambda memory, src_mask: torch.tensor([[0.0, 0.0, 9.0, 0.0]]))  # length 3
    calls = []

    def fake_pass(model, tokens, target_mask, memory, src_mask):
        calls.append(tokens.clone())
        step = len(calls)
        return torch.full(tokens.shape, 10 + step), torch.full(tokens.shape, -1.0 / step)  # later: more confident

    monkeypatch.setattr(cmlm, "predict_masked", fake_pass)
    output = mask_predict(model, torch.tensor([[5, 6, 7]]), torch.tensor([[True] * 3]), iterations=10,
                          length_candidates=1)
    assert [int((tokens == MASK).sum()) for tokens in calls] == [3, 2, 2, 2, 1, 1, 1]
    # ties go to the earlier position: passes 4-7 re-mask {0, 1}, {2}, {0}, {1}, and t = 7..9 change nothing
    assert output == [[16, 17, 15]]


def test_training_masks_between_one_and_all_real_tokens(seeded, tiny_config):
    model = seeded(CMLMModel, tiny_config())
    tgt, tgt_mask = pad_sequences([[5, 6, 7, 8, 9, 10], [5], [6, 7, 8]] * 50)
    batch = {"tgt": tgt, "tgt_mask": tgt_mask}
    masked = model.training_inputs(batch, torch.Generator().manual_seed(0))["masked"]
    counts = masked.sum(dim=1)
    assert not (masked & ~tgt_mask).any() and (counts >= 1).all() and (counts <= tgt_mask.sum(dim=1)).all()
    assert set(counts[0::3].tolist()) == set(range(1, 7))  # every count of a 6-token target occurs
    again = model.training_inputs(batch, torch.Generator().manual_seed(0))["masked"]
    assert torch.equal(masked, again)


@pytest.mark.parametrize("iterations", [1, 4])
def test_decoded_lengths_are_length_candidates(iterations, trained, copy_task):
    model = trained(CMLMModel, 60)
    rows = copy_task[2]
    memory = model.backbone.encode(rows["src"][:6], rows["src_mask"][:6])
    top = model.backbone.length_logits(memory, rows["src_mask"][:6]).topk(2).indices + 1
    outputs = model.generate(rows["src"][:6], rows["src_mask"][:6], iterations=iterations, length_candidates=2)
    assert all(len(output) in top[row].tolist() for row, output in enumerate(outputs))
    assert all(MASK not in output for output in outputs)
