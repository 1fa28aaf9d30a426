"""The AR student: greedy decoding is the argmax of its own teacher-forced pass, and it scores sequences as the
chain rule does, whatever they are batched with."""

from __future__ import annotations

import pytest
import torch

from accelgen.nar.ar import ARStudent, until_eos
from accelgen.nar.backbone import causal_mask
from accelgen.nar.tokens import BOS, EOS, PAD, append_eos, pad_sequences


@pytest.fixture(scope="module")
def student(trained):
    return trained(ARStudent, 60)


def test_greedy_output_is_the_argmax_of_its_teacher_forced_pass(student, copy_task):
    rows = copy_task[2]
    outputs = student.generate(rows["src"][:8], rows["src_mask"][:8])
    assert len({tuple(output) for output in outputs}) > 4  # a trained student: different outputs for different inputs
    targets, target_mask = append_eos(*pad_sequences(outputs))
    logits = student.teacher_forced_logits(rows["src"][:8], rows["src_mask"][:8], targets, target_mask)
    for row, output in enumerate(outputs):
        assert logits[row, :len(output) + 1].argmax(-1).tolist() == output + [EOS]


def test_sequences_are_scored_by_the_chain_rule_batched_or_alone(student, copy_task, assert_reordered):
    rows = copy_task[2]
    src, src_mask = rows["src"][:4], rows["src_mask"][:4]
    candidates = [[5, 6, 7], [8], [9, 10, 11, 12, 13], list(range(5, 5 + student.config.max_target_len))]  # + EOS
    batched = student.sequence_log_probs(src, src_mask, *pad_sequences(candidates))
    for row, candidate in enumerate(candidates):
        alone = student.sequence_log_probs(src[row:row + 1], src_mask[row:row + 1], *pad_sequences([candidate]))
        assert_reordered(batched[row:row + 1], alone)
        memory = student.backbone.encode(src[row:row + 1], src_mask[row:row + 1])
        chain = 0.0
        for position, token in enumerate(candidate + [EOS]):  # log p(token | source, tokens before), one at a time
            inputs = torch.tensor([[BOS] + candidate[:position]])
            with torch.no_grad():
                logits = student.backbone.decode_tokens(inputs, torch.ones_like(inputs, dtype=torch.bool), memory,
                                                        src_mask[row:row + 1], causal_mask(position + 1))
            chain += float(logits[0, -1].log_softmax(-1)[token])
        assert abs(float(batched[row]) - chain) < 1e-4 * abs(chain)


def test_greedy_stops_at_eos_and_at_the_length_limit(student, copy_task):
    rows = copy_task[2]
    assert all(len(output) <= 3 for output in student.generate(rows["src"][:4], rows["src_mask"][:4], max_length=3))
    assert until_eos([5, 6, EOS, 7]) == [5, 6] and until_eos([5, PAD]) == [5]
