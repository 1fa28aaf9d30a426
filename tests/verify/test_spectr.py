"""SpecTr's K-SEQ: K i.i.d. draft sequences, one token selected per depth, exactly target-distributed; the same
rule without its rho scaling is not. Also: the rho it picks is safe and nearly the best, a duplicated prefix
keeps every continuation as a candidate, and one sequence is speculative sampling draw for draw."""

import pytest
import torch

import accelgen.verify.spectr as spectr
from accelgen.draft import ROOT, Draft, Verdict
from accelgen.sampling import sample
from accelgen.verify import verify_node_by_node, verify_spectr

DRAWS = 20_000
NUM_DRAFTS = 4  # sequences of two tokens: a 4 x 1 tree


def first_two_tokens(synthetic, draws: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts, exact), both (VOCAB * VOCAB,): how often each pair of first two committed tokens came out of
    verify_spectr on NUM_DRAFTS i.i.d. two-token draft sequences, and the target's exact law of that pair.
    Draft tokens are drawn for all draws at once; a step that commits one token is completed by sampling the
    target, as the next step would."""
    vocab = synthetic.VOCAB
    tables = torch.Generator().manual_seed(seed)
    target_first, draft_first = synthetic.random_distribution(tables), synthetic.random_distribution(tables)
    target_next = synthetic.random_distribution(tables, vocab)
    draft_next = synthetic.random_distribution(tables, vocab)
    target_bonus = synthetic.random_distribution(tables)
    rng = torch.Generator().manual_seed(seed + 1)
    first = torch.multinomial(draft_first, draws * NUM_DRAFTS, replacement=True, generator=rng)  # (draws * K,)
    second = torch.multinomial(draft_next[first], 1, generator=rng).squeeze(1)
    first, second = first.view(draws, NUM_DRAFTS), second.view(draws, NUM_DRAFTS)
    tokens = torch.cat([first, second], dim=1)  # (draws, 2K): K first tokens, then the K second tokens
    parents = torch.tensor([ROOT] * NUM_DRAFTS + list(range(NUM_DRAFTS)))
    draft_probs = torch.cat([draft_first.expand(draws, NUM_DRAFTS, vocab), draft_next[first]], dim=1)  # (draws, 2K, V)
    target_probs = torch.cat([target_first.expand(draws, 1, vocab), target_next[first],
                              target_bonus.expand(draws, NUM_DRAFTS, vocab)], dim=1)  # (draws, 2K+1, V)
    counts = torch.zeros(vocab, vocab)
    for i in range(draws):
        draft = Draft(tokens[i], parents, draft_probs[i])
        committed = verify_spectr(draft, target_probs[i], rng).new_tokens(draft)
        if len(committed) == 1:
            committed.append(sample(target_next[committed[0]], rng))
        counts[committed[0], committed[1]] += 1
    return counts.flatten(), (target_first[:, None] * target_next).flatten()


def test_k_seq_reproduces_the_target(synthetic):
    counts, exact = first_two_tokens(synthetic, DRAWS)
    assert synthetic.total_variation(counts, exact) < synthetic.tv_bound(synthetic.VOCAB ** 2, DRAWS)


def test_k_seq_without_rho_fails_the_same_test(synthetic, monkeypatch):
    """The deliberately wrong rule: every candidate tried with min(1, p/q), as if it were the only one."""
    monkeypatch.setattr(spectr, "acceptance_scale", lambda draft_probs, target_probs, num_drafts: 1.0)
    counts, exact = first_two_tokens(synthetic, DRAWS // 2)
    assert synthetic.total_variation(counts, exact) > 2 * synthetic.tv_bound(synthetic.VOCAB ** 2, DRAWS // 2)


@pytest.mark.parametrize("num_drafts", [1, 2, 3, 5, 8])
def test_rho_is_safe_nearly_best_and_makes_the_law_exact(synthetic, num_drafts):
    """For the chosen rho: accepted mass never exceeds the target, accepted + residual mass is the target, a
    slightly smaller rho is unsafe, and K drafts accept at least as often as one."""
    tables = torch.Generator().manual_seed(num_drafts)
    for _ in range(20):
        draft_probs = synthetic.random_distribution(tables).double()
        target_probs = synthetic.random_distribution(tables).double()
        rho = spectr.acceptance_scale(draft_probs, target_probs, num_drafts)
        assert 1.0 <= rho <= num_drafts
        accept = torch.minimum(draft_probs, target_probs / rho)  # (vocab,) one candidate is x and accepted
        beta = float(accept.sum())
        none_accepted = (1 - beta) ** num_drafts
        accepted_mass = accept * (1 - none_accepted) / beta  # (vocab,) the output is x after an acceptance
        assert bool((accepted_mass <= target_probs + 1e-9).all())
        residual = spectr.k_seq_residual(draft_probs, target_probs, num_drafts, rho)
        torch.testing.assert_close(accepted_mass + none_accepted * residual, target_probs)
        if num_drafts == 1:
            assert rho == 1.0
            continue
        smaller = rho - 1e-3
        smaller_beta = float(torch.minimum(draft_probs, target_probs / smaller).sum())
        assert (1 - (1 - smaller_beta) ** num_drafts) / smaller_beta > smaller  # unsafe: rho is within 1e-3 of best
        single_draft = float(torch.minimum(draft_probs, target_probs).sum())
        assert 1 - none_accepted >= single_draft - 1e-4


def test_a_duplicated_prefix_keeps_both_continuations():
    """Sequences (1 2) and (1 3): token 1 is selected, then token 3, which hangs under the other copy of 1."""
    vocab = 4
    half = torch.tensor([0.0, 0.5, 0.25, 0.25])
    draft = Draft(torch.tensor([1, 1, 2, 3]), torch.tensor([ROOT, ROOT, 0, 1]), torch.stack([half, half, half, half]))
    target_probs = torch.zeros(5, vocab)
    target_probs[0, 1] = 1.0  # token 1 for sure: accepted (p / (rho q) >= 1 / (2 * 0.5))
    target_probs[1:3, 3] = 1.0  # then token 3 for sure, after either copy of 1
    target_probs[3:, 0] = 1.0  # the bonus
    verdict = verify_spectr(draft, target_probs, torch.Generator().manual_seed(0))
    assert verdict == Verdict([1, 3], 0)


def test_one_sequence_is_speculative_sampling_draw_for_draw(synthetic):
    tables = torch.Generator().manual_seed(7)
    for case in range(100):
        length = 1 + case % 4
        draft_probs = synthetic.random_distribution(tables, length)
        target_probs = synthetic.random_distribution(tables, length + 1)
        draft = Draft.chain(torch.tensor([sample(row, tables) for row in draft_probs]), draft_probs)
        expected = verify_node_by_node(draft, target_probs, torch.Generator().manual_seed(case))
        assert verify_spectr(draft, target_probs, torch.Generator().manual_seed(case)) == expected


def test_sampled_drafts_need_their_distributions():
    with pytest.raises(ValueError, match="draft_probs"):
        verify_spectr(Draft.chain(torch.tensor([1, 2])), torch.full((3, 4), 0.25), None)
