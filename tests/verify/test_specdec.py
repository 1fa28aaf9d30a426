"""Spec-Verification: beta = 1 is greedy verification exactly; looser beta / tau never accept less; the rule on
hand-made logits; bad options are clear errors."""

import pytest
import torch

from accelgen.draft import ROOT, Draft, Verdict
from accelgen.verify import check_specdec_options, verify_greedy, verify_specdec

VOCAB = 16


def random_case(generator, length: int) -> tuple[Draft, torch.Tensor]:
    """A chain of `length` drafted tokens, each the target's top-1, top-2 or a random token, and target logits
    (length+1, VOCAB) with some exact ties (logits rounded to halves)."""
    logits = (torch.randn(length + 1, VOCAB, generator=generator) * 3).round() / 2
    ranked = logits.argsort(dim=-1, descending=True, stable=True)
    tokens = []
    for i in range(length):
        kind = int(torch.randint(3, (), generator=generator))
        tokens.append(int(ranked[i, kind]) if kind < 2 else int(torch.randint(VOCAB, (), generator=generator)))
    return Draft.chain(torch.tensor(tokens)), logits


def test_beta_one_is_greedy_verification_exactly():
    generator = torch.Generator().manual_seed(0)
    for case in range(300):
        draft, logits = random_case(generator, length=case % 6)
        for tau in (0.0, 1.0, 100.0):
            assert verify_specdec(draft, logits, beta=1, tau=tau) == verify_greedy(draft, logits), case


def test_looser_settings_never_accept_less():
    generator = torch.Generator().manual_seed(1)
    settings = [(beta, tau) for beta in (1, 2, 3, 5, VOCAB) for tau in (0.0, 0.5, 1.0, 3.0, float("inf"))]
    totals = {setting: 0 for setting in settings}
    for _ in range(200):
        draft, logits = random_case(generator, length=5)
        accepted = {setting: len(verify_specdec(draft, logits, *setting).accepted) for setting in settings}
        for beta, tau in settings:
            for looser_beta, looser_tau in settings:
                if looser_beta >= beta and looser_tau >= tau:
                    assert accepted[looser_beta, looser_tau] >= accepted[beta, tau]
        for setting in settings:
            totals[setting] += accepted[setting]
    assert totals[VOCAB, float("inf")] == 200 * 5  # no limit: everything accepted
    assert totals[3, 1.0] > totals[1, 0.0]  # the default setting does accept more than greedy here


def test_top_beta_and_tau_on_hand_made_logits():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05],  # row 0: token 1 is second best, log-gap log(5/3) ~ 0.51
                          [0.1, 0.3, 0.2, 0.4],  # row 1: token 2 is third best, log-gap log(2) ~ 0.69
                          [0.7, 0.1, 0.1, 0.1]])  # after the draft: the bonus is token 0
    logits = torch.log(probs)
    draft = Draft.chain(torch.tensor([1, 2]))
    first_gap = float(logits[0, 0] - logits[0, 1])
    assert verify_specdec(draft, logits, beta=1, tau=10.0) == Verdict([], 0)  # greedy
    assert verify_specdec(draft, logits, beta=2, tau=first_gap - 1e-4) == Verdict([], 0)  # too far below the top-1
    assert verify_specdec(draft, logits, beta=2, tau=10.0) == Verdict([0], 3)  # row 1: not in the top 2
    assert verify_specdec(draft, logits, beta=3, tau=first_gap + 1e-4) == Verdict([0], 3)  # row 1: gap 0.69 > tau
    assert verify_specdec(draft, logits, beta=3, tau=1.0) == Verdict([0, 1], 0)  # both, then the bonus


def test_trees_are_refused():
    draft = Draft(torch.tensor([1, 2]), torch.tensor([ROOT, ROOT]))
    with pytest.raises(ValueError, match="chain"):
        verify_specdec(draft, torch.zeros(3, VOCAB), beta=2, tau=1.0)


@pytest.mark.parametrize("beta, tau", [(0, 1.0), (2.5, 1.0), ("3", 1.0), (True, 1.0), (2, -0.1), (2, "1"), (2, float("nan"))])
def test_bad_options_are_clear_errors(beta, tau):
    with pytest.raises(ValueError, match="specdec: (beta|tau)"):
        check_specdec_options(beta, tau)
