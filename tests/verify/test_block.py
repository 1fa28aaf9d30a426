"""Block verification (Sun et al. 2024): exact on chains; more accepted tokens than token-wise verification
(the paper's example: 11/9 against 10/9); greedy on one-hot targets; a plausible wrong block rule fails."""

import pytest
import torch

from accelgen.draft import ROOT, Draft, Verdict
from accelgen.sampling import sample
from accelgen.verify import verify_block, verify_greedy, verify_speculative_sampling

DRAWS = 20_000


def stops_at_weight(draft: Draft, target_probs, generator) -> Verdict:
    """A deliberately wrong block rule: keeps the longest prefix i whose uniform passes weight_i (ignoring the
    leftover mass), then draws the next token from the target as if nothing had been rejected."""
    weight, accepted = 1.0, []
    for i, token in enumerate(draft.tokens.tolist()):
        weight = min(1.0, weight * float(target_probs[i, token] / draft.draft_probs[i, token]))
        if float(torch.rand((), generator=generator)) <= weight:
            accepted = list(range(i + 1))
    return Verdict(accepted, sample(target_probs[len(accepted)], generator))


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])  # another seed: slow set
def test_block_verification_reproduces_the_target(synthetic, seed):
    counts, exact = synthetic.first_two_tokens(verify_block, [1, 1], synthetic.draw_with_replacement, seed=seed,
                                               draws=DRAWS)
    assert synthetic.total_variation(counts, exact) < synthetic.tv_bound(synthetic.VOCAB ** 2, DRAWS)


def test_a_wrong_block_rule_fails_the_same_test(synthetic):
    counts, exact = synthetic.first_two_tokens(stops_at_weight, [1, 1], synthetic.draw_with_replacement, seed=0,
                                               draws=DRAWS)
    assert synthetic.total_variation(counts, exact) > 1.5 * synthetic.tv_bound(synthetic.VOCAB ** 2, DRAWS)


def mean_accepted(rule, draft_probs: torch.Tensor, target_probs: torch.Tensor, gamma: int, draws: int, seed: int):
    """Mean accepted draft tokens of `rule` on context-free models: every position has the same draft_probs
    (vocab,) and target_probs (vocab,)."""
    rng = torch.Generator().manual_seed(seed)
    total = 0
    for _ in range(draws):
        tokens = torch.tensor([sample(draft_probs, rng) for _ in range(gamma)])
        draft = Draft.chain(tokens, draft_probs.repeat(gamma, 1))
        total += len(rule(draft, target_probs.repeat(gamma + 1, 1), rng).accepted)
    return total / draws


@pytest.mark.slow  # 40,000 verifications; the tests above check block verification's law by default
def test_the_papers_example_accepts_more_than_token_wise():
    """Binary vocabulary, target (1/3, 2/3), draft (2/3, 1/3), two draft tokens: token-wise verification
    accepts 10/9 tokens on average, block verification 11/9 (Sun et al. 2024, section 1)."""
    target_probs, draft_probs = torch.tensor([1 / 3, 2 / 3]), torch.tensor([2 / 3, 1 / 3])
    token_wise = mean_accepted(verify_speculative_sampling, draft_probs, target_probs, 2, DRAWS, seed=0)
    block = mean_accepted(verify_block, draft_probs, target_probs, 2, DRAWS, seed=0)
    noise = 4 * 0.8 / DRAWS ** 0.5  # 4 standard errors (accepted length 0..2 has std < 0.8)
    assert abs(token_wise - 10 / 9) < noise and abs(block - 11 / 9) < noise


@pytest.mark.parametrize("seed", [3, pytest.param(4, marks=pytest.mark.slow), pytest.param(5, marks=pytest.mark.slow)])
def test_block_never_accepts_fewer_than_token_wise(synthetic, seed):
    tables = torch.Generator().manual_seed(seed)
    draft_probs, target_probs = synthetic.random_distribution(tables, 2)
    token_wise = mean_accepted(verify_speculative_sampling, draft_probs, target_probs, 4, DRAWS // 4, seed)
    block = mean_accepted(verify_block, draft_probs, target_probs, 4, DRAWS // 4, seed)
    assert block > token_wise - 4 * 1.5 / (DRAWS // 4) ** 0.5  # at least as many, up to noise


def test_one_hot_targets_and_drafts_reduce_to_greedy(synthetic):
    tables = torch.Generator().manual_seed(8)
    for case in range(200):
        length = 1 + case % 5
        target_logits = torch.log(synthetic.random_distribution(tables, length + 1))
        best = target_logits.argmax(-1)
        tokens = torch.where(torch.rand(length, generator=tables) < 0.7, best[:length], (best[:length] + 1) % synthetic.VOCAB)
        one_hot = torch.nn.functional.one_hot(best, synthetic.VOCAB).float()
        draft = Draft.chain(tokens)  # no draft_probs: point masses on the drafted tokens
        assert verify_block(draft, one_hot, tables) == verify_greedy(draft, target_logits)


def test_a_tree_is_refused():
    draft = Draft(torch.tensor([1, 2]), torch.tensor([ROOT, ROOT]))
    with pytest.raises(ValueError, match="chain"):
        verify_block(draft, torch.full((3, 4), 0.25), None)
