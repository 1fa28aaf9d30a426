"""BiLD's rollback rule: threshold 0 is greedy verification exactly; the cross-entropy threshold on hand-made
distributions; a larger threshold never rolls back more."""

import math

import pytest
import torch

from accelgen.draft import ROOT, Draft, Verdict
from accelgen.verify import verify_bild, verify_greedy
from accelgen.verify.bild import rollback_distances

VOCAB = 16


def random_case(generator, length: int) -> tuple[Draft, torch.Tensor]:
    logits = torch.randn(length + 1, VOCAB, generator=generator) * 3
    tokens = [int(logits[i].argmax()) if torch.rand((), generator=generator) < 0.6
              else int(torch.randint(VOCAB, (), generator=generator)) for i in range(length)]
    return Draft.chain(torch.tensor(tokens, dtype=torch.long)), logits


def test_threshold_zero_is_greedy_verification_exactly():
    generator = torch.Generator().manual_seed(0)
    for case in range(300):
        draft, logits = random_case(generator, length=case % 7)
        assert verify_bild(draft, logits, rollback_threshold=0.0) == verify_greedy(draft, logits), case


def test_a_larger_threshold_never_rolls_back_more():
    generator = torch.Generator().manual_seed(1)
    thresholds = [0.0, 0.5, 1.0, 2.0, 5.0, math.inf]
    for _ in range(200):
        draft, logits = random_case(generator, length=5)
        accepted = [len(verify_bild(draft, logits, threshold).accepted) for threshold in thresholds]
        assert accepted == sorted(accepted) and accepted[-1] == 5


def test_cross_entropy_threshold_on_hand_made_distributions():
    probs = torch.tensor([[0.6, 0.3, 0.1, 0.0], [0.2, 0.1, 0.7, 0.0], [0.1, 0.1, 0.1, 0.7]])  # (3, 4)
    logits = torch.log(probs)
    draft = Draft.chain(torch.tensor([1, 1]))  # -log 0.3 = 1.20, then -log 0.1 = 2.30
    torch.testing.assert_close(rollback_distances(logits[:2], draft.tokens), -torch.log(torch.tensor([0.3, 0.1])))
    assert verify_bild(draft, logits, rollback_threshold=1.0) == Verdict([], 0)  # rolled back at once
    assert verify_bild(draft, logits, rollback_threshold=2.0) == Verdict([0], 2)  # second token rolled back
    assert verify_bild(draft, logits, rollback_threshold=2.5) == Verdict([0, 1], 3)  # kept; then the large model's
    # a token the large model ranks first is kept even when its own probability is low
    flat = torch.log(torch.tensor([[0.3, 0.25, 0.25, 0.2], [0.7, 0.1, 0.1, 0.1]]))
    assert verify_bild(Draft.chain(torch.tensor([0])), flat, rollback_threshold=0.5) == Verdict([0], 0)


def test_trees_are_refused():
    with pytest.raises(ValueError, match="chain"):
        verify_bild(Draft(torch.tensor([1, 2]), torch.tensor([ROOT, ROOT])), torch.zeros(3, VOCAB), 1.0)
