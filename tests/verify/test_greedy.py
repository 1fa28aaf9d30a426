import torch

from accelgen.draft import ROOT, Draft
from accelgen.verify import verify_greedy

VOCAB = 10


def logits_preferring(tokens: list[int]) -> torch.Tensor:
    """(len, VOCAB) logits whose argmax in row r is tokens[r]."""
    logits = torch.zeros(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_all_accepted_gives_bonus_token():
    draft = Draft.chain(torch.tensor([3, 4, 5]))
    verdict = verify_greedy(draft, logits_preferring([3, 4, 5, 6]))
    assert verdict.accepted == [0, 1, 2] and verdict.next_token == 6


def test_none_accepted_gives_target_token():
    draft = Draft.chain(torch.tensor([3, 4, 5]))
    verdict = verify_greedy(draft, logits_preferring([7, 4, 5, 6]))
    assert verdict.accepted == [] and verdict.next_token == 7


def test_partial_acceptance_stops_at_first_mismatch():
    draft = Draft.chain(torch.tensor([3, 4, 5]))
    verdict = verify_greedy(draft, logits_preferring([3, 4, 9, 6]))
    assert verdict.accepted == [0, 1] and verdict.next_token == 9


def test_empty_draft_is_plain_greedy():
    verdict = verify_greedy(Draft.empty(), logits_preferring([8]))
    assert verdict.accepted == [] and verdict.next_token == 8


def test_tree_follows_the_matching_branch():
    #   root ─ 3(0) ─ 4(1)
    #        └ 5(2) ─ 6(3) ─ 1(4)
    draft = Draft(torch.tensor([3, 4, 5, 6, 1]), torch.tensor([ROOT, 0, ROOT, 2, 3]))
    # rows: root, after 3, after 4, after 5, after 6, after 1
    verdict = verify_greedy(draft, logits_preferring([5, 0, 0, 6, 2, 0]))
    assert verdict.accepted == [2, 3] and verdict.next_token == 2


def test_width_one_tree_equals_chain():
    tokens = torch.tensor([3, 4, 5])
    logits = logits_preferring([3, 4, 9, 6])
    as_tree = Draft(tokens, torch.tensor([ROOT, 0, 1]))
    assert verify_greedy(as_tree, logits) == verify_greedy(Draft.chain(tokens), logits)
