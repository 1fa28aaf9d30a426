"""Typical acceptance: the entropy-dependent threshold, the deepest fully passing path, looser = more accepted."""

import torch

from accelgen.draft import Draft
from accelgen.verify.typical import typical_passes, verify_typical

# root: sure of token 0 (p ≈ 0.97); after node 0: torn between tokens 1, 2 and 3; after node 1: sure of 4
LOGITS = torch.tensor([[6.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                       [0.0, 3.0, 3.0, 3.0, 0.0, 0.0],
                       [0.0, 0.0, 0.0, 0.0, 6.0, 0.0],
                       [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])


def test_a_sure_target_accepts_only_its_choice_and_a_torn_one_accepts_its_candidates():
    draft = Draft(torch.tensor([0, 2, 1, 5]), torch.tensor([-1, 0, 0, -1]))  # root ─ 0 ─ 2, 0 ─ 1; root ─ 5
    assert typical_passes(LOGITS, draft, epsilon=0.09, delta=0.3).tolist() == [True, True, True, False]
    verdict = verify_typical(draft, LOGITS, epsilon=0.09, delta=0.3)
    assert verdict.accepted == [0, 1] and verdict.next_token == 4  # token 2 is not the argmax (tie goes to 1)


def test_nothing_passing_gives_the_targets_own_token():
    draft = Draft.chain(torch.tensor([3, 3]))
    assert verify_typical(draft, LOGITS, epsilon=0.09, delta=0.3).accepted == []
    assert verify_typical(draft, LOGITS, epsilon=0.09, delta=0.3).next_token == 0
    assert verify_typical(Draft.empty(), LOGITS, 0.09, 0.3).next_token == 0


def test_looser_settings_accept_more():
    draft = Draft.chain(torch.tensor([0, 4, 1]))  # the second token is unlikely where the target is torn
    strict = verify_typical(draft, LOGITS, epsilon=0.09, delta=0.3)
    loose = verify_typical(draft, LOGITS, epsilon=0.0, delta=0.3)  # min(0, ·) = 0: any token with p > 0 passes
    assert len(strict.accepted) == 1 and len(loose.accepted) == 3
