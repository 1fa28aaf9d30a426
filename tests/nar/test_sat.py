"""Semi-autoregressive decoding: the group-causal mask, K = 1 is greedy autoregressive decoding token for token,
K = 2 decodes what its own teacher-forced pass predicts, in ceil(n / K) decoder passes."""

from __future__ import annotations

import math

import pytest
import torch

from accelgen.nar.ar import ARStudent
from accelgen.nar.backbone import causal_mask
from accelgen.nar.sat import SATModel, group_causal_mask, semi_autoregressive_decode
from accelgen.nar.tokens import EOS, append_eos, pad_sequences


def test_the_group_causal_mask_hides_later_groups_only():
    assert group_causal_mask(5, 2).int().tolist() == [[0, 0, 1, 1, 1],
                                                       [0, 0, 1, 1, 1],
                                                       [0, 0, 0, 0, 1],
                                                       [0, 0, 0, 0, 1],
                                                       [0, 0, 0, 0, 0]]
    assert torch.equal(group_causal_mask(7, 1), causal_mask(7))


@pytest.mark.parametrize("steps", [0, 60])
def test_one_token_per_group_is_greedy_autoregressive_decoding(steps, trained, seeded, tiny_config, copy_task):
    student = trained(ARStudent, steps) if steps else seeded(ARStudent, tiny_config())
    rows = copy_task[2]
    greedy = student.generate(rows["src"], rows["src_mask"])
    assert semi_autoregressive_decode(student.backbone, rows["src"], rows["src_mask"], group_size=1) == greedy
    if steps:
        assert len({tuple(output) for output in greedy}) > 10


def test_groups_decode_what_the_teacher_forced_pass_predicts(trained, copy_task):
    model = trained(SATModel, 60, group_size=2)
    rows = copy_task[2]
    outputs = model.generate(rows["src"][:8], rows["src_mask"][:8])
    assert len({tuple(output) for output in outputs}) > 4
    targets, target_mask = append_eos(*pad_sequences(outputs))
    logits = model.teacher_forced_logits(rows["src"][:8], rows["src_mask"][:8], targets, target_mask)
    for row, output in enumerate(outputs):
        assert logits[row, :len(output) + 1].argmax(-1).tolist() == output + [EOS]


def test_k_tokens_come_out_of_each_decoder_pass(trained, copy_task, monkeypatch):
    model = trained(SATModel, 60, group_size=2)
    rows = copy_task[2]
    passes = []
    decode = model.backbone.decode_tokens
    monkeypatch.setattr(model.backbone, "decode_tokens", lambda *args: passes.append(1) or decode(*args))
    output = model.generate(rows["src"][:1], rows["src_mask"][:1])[0]
    assert len(passes) == math.ceil((len(output) + 1) / 2)  # the output and its EOS, two per pass
