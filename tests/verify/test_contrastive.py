"""Contrastive verification: alpha = 0 is greedy verification exactly; the contrast and the plausibility cut-off
on hand-made distributions; the step after a fully accepted draft; errors."""

import math

import pytest
import torch

from accelgen.draft import ROOT, Draft, Verdict
from accelgen.verify import check_contrastive_options, verify_contrastive, verify_greedy
from accelgen.verify.contrastive import contrastive_scores

VOCAB = 16


def random_case(generator, length: int) -> tuple[Draft, torch.Tensor]:
    """A chain of `length` tokens (each the expert's argmax or not, at random) carrying random amateur
    distributions, and expert logits (length+1, VOCAB)."""
    logits = torch.randn(length + 1, VOCAB, generator=generator) * 3
    amateur = torch.softmax(torch.randn(length, VOCAB, generator=generator) * 3, dim=-1)
    tokens = [int(logits[i].argmax()) if torch.rand((), generator=generator) < 0.7
              else int(torch.randint(VOCAB, (), generator=generator)) for i in range(length)]
    return Draft.chain(torch.tensor(tokens, dtype=torch.long), amateur if length else None), logits


def test_alpha_zero_is_greedy_verification_exactly():
    generator = torch.Generator().manual_seed(0)
    for case in range(300):
        draft, logits = random_case(generator, length=case % 6)
        for beta in (0.0, 0.1, 1.0):
            assert verify_contrastive(draft, logits, alpha=0.0, beta=beta) == verify_greedy(draft, logits), case


def test_the_contrast_and_the_plausibility_cut_off():
    expert = torch.log(torch.tensor([[0.5, 0.4, 0.09, 0.01]]))
    amateur = torch.tensor([[0.9, 0.05, 0.04, 0.01]])
    # token 1: log 0.4 - 0.5 log 0.05 = 0.58 beats token 0: log 0.5 - 0.5 log 0.9 = -0.64
    assert int(contrastive_scores(expert, amateur, alpha=0.5, beta=0.1).argmax()) == 1
    # beta = 0.9: token 1 (0.4 < 0.9 * 0.5) is implausible, so the expert's own choice stays
    assert int(contrastive_scores(expert, amateur, alpha=0.5, beta=0.9).argmax()) == 0
    # an amateur probability that underflowed to 0 gives a large, finite score; implausible tokens stay -inf
    scores = contrastive_scores(expert, torch.tensor([[0.5, 0.5, 0.0, 0.0]]), alpha=1.0, beta=0.05)
    assert int(scores.argmax()) == 2 and math.isfinite(float(scores[0, 2])) and scores[0, 3] == -math.inf


def test_verdicts_on_a_hand_made_draft():
    expert = torch.log(torch.tensor([[0.5, 0.4, 0.09, 0.01]] * 3))  # the same position three times
    amateur = torch.tensor([[0.9, 0.05, 0.04, 0.01]] * 2)  # contrastive choice: token 1 (see above)
    mismatch = Draft.chain(torch.tensor([1, 0]), amateur)
    assert verify_contrastive(mismatch, expert, alpha=0.5, beta=0.1) == Verdict([0], 1)
    # all accepted: the amateur never scored the position after the draft, so its last token is committed
    # as the next token instead (the same tokens), not followed by an expert-only bonus
    matched = Draft.chain(torch.tensor([1, 1]), amateur)
    verdict = verify_contrastive(matched, expert, alpha=0.5, beta=0.1)
    assert verdict == Verdict([0], 1) and verdict.new_tokens(matched) == [1, 1]
    # an empty draft: the expert's argmax
    assert verify_contrastive(Draft.empty(), expert[:1], alpha=0.5, beta=0.1) == Verdict([], 0)


def test_drafts_without_amateur_distributions_and_trees_are_refused():
    with pytest.raises(ValueError, match="draft_probs"):
        verify_contrastive(Draft.chain(torch.tensor([1])), torch.zeros(2, VOCAB), alpha=0.5, beta=0.1)
    tree = Draft(torch.tensor([1, 2]), torch.tensor([ROOT, ROOT]), torch.full((2, VOCAB), 1 / VOCAB))
    with pytest.raises(ValueError, match="chain"):
        verify_contrastive(tree, torch.zeros(3, VOCAB), alpha=0.5, beta=0.1)


@pytest.mark.parametrize("alpha, beta", [(-0.5, 0.1), ("0.5", 0.1), (0.5, 1.5), (0.5, -0.1), (0.5, None)])
def test_bad_options_are_clear_errors(alpha, beta):
    with pytest.raises(ValueError, match="contrastive: (alpha|beta)"):
        check_contrastive_options(alpha, beta)
