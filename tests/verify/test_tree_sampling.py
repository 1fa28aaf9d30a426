"""SpecInfer's multi-step speculative sampling over token trees whose siblings are drawn i.i.d. from the draft
(verify_speculative_sampling): exact; a rule that forgets the residual between siblings is not; and every
rule verifies a width-1 tree exactly like a chain (same seed, same verdict)."""

import torch

from accelgen.draft import ROOT, Draft, Verdict, children
from accelgen.sampling import sample
from accelgen.verify import verify_block, verify_greedy, verify_speculative_sampling, verify_without_replacement

DRAWS = 20_000
BRANCHING = [3, 2]  # three i.i.d. candidates for the first token, two for the second under each


def forgets_the_residual(draft: Draft, target_probs, generator) -> Verdict:
    """A deliberately wrong tree rule: tries every sibling against the full target distribution."""
    tokens, kids = draft.tokens.tolist(), children(draft.parents)
    node, accepted = ROOT, []
    while True:
        probs = target_probs[node + 1]
        for child in kids[node]:
            if torch.rand((), generator=generator) * draft.draft_probs[child, tokens[child]] < probs[tokens[child]]:
                accepted.append(child)
                node = child
                break
        else:
            return Verdict(accepted, sample(probs, generator))


def test_tree_of_iid_siblings_reproduces_the_target(synthetic):
    counts, exact = synthetic.first_two_tokens(verify_speculative_sampling, BRANCHING, synthetic.draw_with_replacement,
                                               seed=0, draws=DRAWS)
    assert synthetic.total_variation(counts, exact) < synthetic.tv_bound(synthetic.VOCAB ** 2, DRAWS)


def test_forgetting_the_residual_fails_the_same_test(synthetic):
    counts, exact = synthetic.first_two_tokens(forgets_the_residual, BRANCHING, synthetic.draw_with_replacement,
                                               seed=0, draws=DRAWS // 4)
    assert synthetic.total_variation(counts, exact) > 2 * synthetic.tv_bound(synthetic.VOCAB ** 2, DRAWS // 4)


def chain_speculative_sampling(tokens: list[int], draft_probs, target_probs, generator) -> Verdict:
    """Reference: Leviathan/Chen token-wise rule on a chain, written without any tree machinery."""
    for i, token in enumerate(tokens):
        if torch.rand((), generator=generator) * draft_probs[i, token] >= target_probs[i, token]:
            residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
            return Verdict(list(range(i)), sample(residual / residual.sum(), generator))
    return Verdict(list(range(len(tokens))), sample(target_probs[len(tokens)], generator))


def test_width_one_tree_is_verified_like_a_chain(synthetic):
    """Every tree rule on a width-1 tree, rows given per node, equals the chain reference draw for draw
    (block verification only for one token: on longer chains it is a different, better rule)."""
    tables = torch.Generator().manual_seed(7)
    for case in range(150):
        length = 1 + case % 4
        draft_probs = synthetic.random_distribution(tables, length)
        target_probs = synthetic.random_distribution(tables, length + 1)
        tokens = [sample(row, tables) for row in draft_probs]
        tree = Draft(torch.tensor(tokens), torch.arange(length) - 1, draft_probs)
        expected = chain_speculative_sampling(tokens, draft_probs, target_probs, torch.Generator().manual_seed(case))
        rules = [verify_speculative_sampling, verify_without_replacement] + ([verify_block] if length == 1 else [])
        for rule in rules:
            assert rule(tree, target_probs, torch.Generator().manual_seed(case)) == expected, (rule.__name__, case)
        greedy_target = torch.log(target_probs)
        longest = next((i for i, t in enumerate(tokens) if t != int(greedy_target[i].argmax())), length)
        assert verify_greedy(tree, greedy_target) == Verdict(list(range(longest)), int(greedy_target[longest].argmax()))
