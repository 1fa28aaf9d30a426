"""NAT: decoder inputs copied by fertility or uniformly, the lexical alignment its fertilities are trained on, one
parallel pass, and noisy parallel decoding returning the candidate its scorer scores best in one batched call.
Also: the metric catches a decoder with a copying bug."""

from __future__ import annotations

import pytest
import sacrebleu
import torch

from accelgen.nar import nat
from accelgen.nar.ar import ARStudent
from accelgen.nar.nat import (NATModel, copy_positions, lexical_alignment, lexical_fertilities, noisy_parallel_decode,
                              uniform_fertilities, uniform_positions)
from accelgen.nar.tokens import pad_sequences


def test_uniform_copy_spreads_the_target_over_the_source():
    assert uniform_positions(5, 3) == [0, 2, 4]
    assert uniform_positions(2, 4) == [0, 0, 1, 1]
    assert uniform_positions(3, 1) == [1]
    fertility = uniform_fertilities(torch.tensor([5, 2]), torch.tensor([3, 4]), width=6)
    assert fertility.tolist() == [[1, 0, 1, 0, 1, 0], [2, 2, 0, 0, 0, 0]]
    positions, mask = copy_positions(fertility)
    assert positions[0, :3].tolist() == [0, 2, 4] and positions[1].tolist() == [0, 0, 1, 1]
    assert mask.tolist() == [[True, True, True, False], [True] * 4]


def test_copies_follow_the_fertilities_in_source_order():
    positions, mask = copy_positions(torch.tensor([[2, 0, 1, 0], [0, 0, 0, 3]]))
    assert positions.tolist() == [[0, 0, 2], [3, 3, 3]] and mask.all()
    positions, mask = copy_positions(torch.tensor([[1, 1, 0, 0], [0, 0, 0, 5]]), width=4)  # cut at 4 positions
    assert positions[0, :2].tolist() == [0, 1] and positions[1].tolist() == [3] * 4
    assert mask.tolist() == [[True, True, False, False], [True] * 4]


def test_the_lexical_alignment_copies_identical_tokens_and_respects_fertility_limits():
    source = [10, 11, 12, 13, 11]
    assert lexical_alignment(source, [11, 13], max_fertility=2) == [1, 3]  # the 11 nearer its uniform position 1
    assert lexical_alignment(source, [13, 11, 11], max_fertility=2) == [3, 1, 4]  # uniform positions 0, 2, 4
    assert lexical_alignment(source, [13, 11, 11, 11], max_fertility=2) == [3, 1, 4, 4]
    assert lexical_alignment(source, [13, 11, 11, 11], max_fertility=1) == [3, 1, 4, 2]  # both 11s full: the
    # free position nearest the last one's uniform position 4
    assert lexical_alignment(source, [99, 98], max_fertility=1) == [1, 3]  # no identical token: uniform
    assert lexical_alignment([10, 11], [10, 10, 10], max_fertility=2) == [0, 0, 1]  # 0 full: its neighbour
    with pytest.raises(ValueError, match="raise max_fertility"):
        lexical_alignment([10], [10, 10, 10], max_fertility=2)
    src, src_mask = pad_sequences([source, [10, 11]])
    tgt, tgt_mask = pad_sequences([[13, 11, 11, 11], [10]])
    fertility = lexical_fertilities(src, src_mask, tgt, tgt_mask, max_fertility=2)
    assert fertility.tolist() == [[0, 1, 0, 1, 2], [1, 0, 0, 0, 0]]


@pytest.mark.parametrize("decoder_inputs", ["fertility", "uniform"])
def test_the_parallel_pass_reads_copies_of_the_source_embeddings(decoder_inputs, seeded, tiny_config, copy_task):
    model = seeded(NATModel, tiny_config(), decoder_inputs=decoder_inputs)
    rows = copy_task[2]
    src, src_mask = rows["src"][:2], rows["src_mask"][:2]
    memory = model.backbone.encode(src, src_mask)
    fertility = model.fertility_candidates(memory, src_mask)[:, 0]
    logits, mask = model.parallel_logits(src, src_mask, memory, fertility)
    positions, _ = copy_positions(fertility)
    inputs = torch.stack([model.backbone.embed_tokens(src[row])[positions[row]] for row in range(2)])
    expected = model.backbone.logits(model.backbone.decode(inputs, mask, memory, src_mask))
    torch.testing.assert_close(logits, expected)
    outputs = model.generate(src, src_mask)
    assert [len(output) for output in outputs] == fertility.sum(dim=1).clamp(1, 12).tolist()


def test_noisy_parallel_decoding_returns_what_the_scorer_scores_best(trained, copy_task):
    model = trained(NATModel, 60)
    rows = copy_task[2]
    src, src_mask = rows["src"][:4], rows["src_mask"][:4]
    calls = []

    def longest_first(src_ids, src_mask, candidates, candidate_mask):  # a scorer that likes long candidates
        calls.append(len(candidates))
        return candidate_mask.sum(dim=1).float() - 0.01 * candidates[:, 0].float()

    result = noisy_parallel_decode(model, src, src_mask, longest_first, samples=6,
                                   generator=torch.Generator().manual_seed(0))
    assert calls == [4 * 6]  # every candidate of every source in one call
    assert result.scores.shape == (4, 6)
    for row in range(4):
        assert result.candidates[row][0] == model.generate(src[row:row + 1], src_mask[row:row + 1])[0]
        expected = max(result.candidates[row], key=lambda candidate: (len(candidate), -candidate[0]))
        assert result.sequences[row] == expected
    assert len({len(candidate) for candidates in result.candidates for candidate in candidates}) > 1  # sampled


@pytest.mark.parametrize("decoder_inputs", ["fertility", "uniform"])
def test_the_ar_student_scores_all_candidates_in_one_batched_pass(decoder_inputs, trained, copy_task):
    model, student = trained(NATModel, 60, decoder_inputs=decoder_inputs), trained(ARStudent, 60)
    rows = copy_task[2]
    src, src_mask = rows["src"][:3], rows["src_mask"][:3]
    calls = []

    def scorer(*arguments):
        calls.append(1)
        return student.sequence_log_probs(*arguments)

    result = noisy_parallel_decode(model, src, src_mask, scorer, samples=5, temperature=2.0,
                                   generator=torch.Generator().manual_seed(1))
    assert len(calls) == 1
    for row in range(3):
        alone = student.sequence_log_probs(src[row:row + 1].expand(5, -1), src_mask[row:row + 1].expand(5, -1),
                                           *pad_sequences(result.candidates[row]))
        torch.testing.assert_close(result.scores[row], alone, rtol=0, atol=1e-4 * float(alone.abs().max()))
        assert result.sequences[row] == result.candidates[row][int(alone.argmax())]


def test_the_metric_catches_a_decoder_that_copies_the_wrong_source_positions(trained, copy_task, monkeypatch):
    model = trained(NATModel, 60)
    vocabulary, _, rows, pairs = copy_task
    references = [summary for _, summary in pairs]

    def scores() -> tuple[float, float]:
        texts = [vocabulary.decode(output) for output in model.generate(rows["src"], rows["src_mask"])]
        return sacrebleu.corpus_bleu(texts, [references]).score, sacrebleu.corpus_chrf(texts, [references]).score

    bleu, chrf = scores()
    assert bleu > 60 and chrf > 70  # the copy task is learnt

    def off_by_one(fertility, width=None):  # each decoder position copies the source token after the right one
        positions, mask = copy_positions(fertility, width)
        return (positions + 1).clamp(max=fertility.shape[1] - 1), mask

    monkeypatch.setattr(nat, "copy_positions", off_by_one)
    broken_bleu, broken_chrf = scores()
    assert broken_bleu < bleu / 2 and broken_chrf < chrf - 20
