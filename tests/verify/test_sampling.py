"""Speculative sampling must reproduce the target distribution exactly; a wrong verifier must fail the same test.

The bound on total variation is derived from the sample size: E[TV] <= 0.5 * sqrt(V / N) (Cauchy-Schwarz on
E|p_hat - p| <= sqrt(p / N)), and TV concentrates around its mean within sqrt(ln(1/delta) / (2N)) (McDiarmid),
so a correct sampler exceeds the bound with probability below delta = 1e-6.
"""

import pytest
import torch

from accelgen.draft import ROOT, Draft, Verdict
from accelgen.sampling import sample
from accelgen.verify import verify_node_by_node, verify_speculative_sampling

from .conftest import VOCAB, random_distribution, total_variation, tv_bound

DRAWS = 20_000


def always_accept(draft: Draft, target_probs, generator) -> Verdict:
    """A deliberately wrong verifier: trusts the draft blindly."""
    return Verdict(list(range(len(draft))), sample(target_probs[len(draft)], generator))


def two_token_frequencies(verifier, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empirical joint law of the first two committed tokens with a 2-token chain draft, and the exact target law.

    Target: first token ~ target_first, second ~ target_next[first]. Draft: its own q tables. When a step commits
    only one token, the second comes from the next step, which samples the target directly.
    """
    tables = torch.Generator().manual_seed(seed)
    target_first, draft_first = random_distribution(tables), random_distribution(tables)
    target_next, draft_next = random_distribution(tables, VOCAB), random_distribution(tables, VOCAB)
    target_bonus = random_distribution(tables)
    rng = torch.Generator().manual_seed(seed + 1)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(DRAWS):
        first_draft = sample(draft_first, rng)
        second_draft = sample(draft_next[first_draft], rng)
        draft = Draft.chain(torch.tensor([first_draft, second_draft]), torch.stack([draft_first, draft_next[first_draft]]))
        target_probs = torch.stack([target_first, target_next[first_draft], target_bonus])
        committed = verifier(draft, target_probs, rng).new_tokens(draft)
        if len(committed) == 1:
            committed.append(sample(target_next[committed[0]], rng))
        counts[committed[0], committed[1]] += 1
    exact = target_first[:, None] * target_next
    return counts.flatten(), exact.flatten()


@pytest.mark.parametrize("rule", [verify_speculative_sampling, verify_node_by_node])
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])  # another seed: slow set
def test_speculative_sampling_reproduces_the_target(seed, rule):
    counts, exact = two_token_frequencies(rule, seed)
    assert total_variation(counts, exact) < tv_bound(VOCAB * VOCAB, DRAWS)


def test_always_accepting_verifier_fails_the_same_test():
    counts, exact = two_token_frequencies(always_accept, seed=0)
    assert total_variation(counts, exact) > 3 * tv_bound(VOCAB * VOCAB, DRAWS)


@pytest.mark.parametrize("rule", [verify_speculative_sampling, verify_node_by_node])
def test_deterministic_tree_draft_reproduces_the_target(rule):
    """A model-free draft (no draft_probs) with three alternatives for the first token: still exact."""
    tables = torch.Generator().manual_seed(3)
    target_first = random_distribution(tables)
    draft = Draft(torch.tensor([4, 7, 1]), torch.tensor([ROOT, ROOT, ROOT]))
    target_probs = torch.stack([target_first] + [random_distribution(tables) for _ in range(3)])
    rng = torch.Generator().manual_seed(4)
    counts = torch.zeros(VOCAB)
    for _ in range(DRAWS):
        counts[rule(draft, target_probs, rng).new_tokens(draft)[0]] += 1
    assert total_variation(counts, target_first) < tv_bound(VOCAB, DRAWS)


def test_identical_draft_and_target_accept_everything():
    probs = random_distribution(torch.Generator().manual_seed(5), 4)
    rng = torch.Generator().manual_seed(6)
    draft = Draft.chain(torch.tensor([sample(probs[0], rng), sample(probs[1], rng), sample(probs[2], rng)]), probs[:3])
    assert verify_speculative_sampling(draft, probs, rng).accepted == [0, 1, 2]


def test_draft_token_the_target_forbids_is_rejected():
    target = torch.zeros(2, VOCAB)
    target[:, 3] = 1.0
    draft = Draft.chain(torch.tensor([5]), torch.full((1, VOCAB), 1.0 / VOCAB))
    verdict = verify_speculative_sampling(draft, target, torch.Generator().manual_seed(0))
    assert verdict.accepted == [] and verdict.next_token == 3
