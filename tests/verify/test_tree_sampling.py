"""SpecInfer's multi-step speculative sampling over token trees whose siblings are drawn i.i.d. from the draft:
exact; a rule that forgets the residual between siblings is not. Both implementations of the rule, the one that
decides on the device (verify_speculative_sampling) and the walk one test at a time (verify_node_by_node), give
each fixed draft's verdicts with the law computed exactly by enumerating the walk; the walk verifies a width-1
tree exactly like a chain (same seed, same verdict)."""

from collections import Counter

import pytest
import torch

from accelgen.draft import ROOT, Draft, Verdict, children
from accelgen.sampling import sample
from accelgen.verify import (verify_block, verify_greedy, verify_node_by_node, verify_speculative_sampling,
                             verify_without_replacement)

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


@pytest.mark.parametrize("rule", [verify_speculative_sampling, verify_node_by_node])
def test_tree_of_iid_siblings_reproduces_the_target(synthetic, rule):
    counts, exact = synthetic.first_two_tokens(rule, BRANCHING, synthetic.draw_with_replacement, seed=0, draws=DRAWS)
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
    """The rules that draw as the chain reference does, on a width-1 tree with rows given per node, equal it draw
    for draw (block verification only for one token: on longer chains it is a different, better rule)."""
    tables = torch.Generator().manual_seed(7)
    for case in range(150):
        length = 1 + case % 4
        draft_probs = synthetic.random_distribution(tables, length)
        target_probs = synthetic.random_distribution(tables, length + 1)
        tokens = [sample(row, tables) for row in draft_probs]
        tree = Draft(torch.tensor(tokens), torch.arange(length) - 1, draft_probs)
        expected = chain_speculative_sampling(tokens, draft_probs, target_probs, torch.Generator().manual_seed(case))
        rules = [verify_node_by_node] + ([verify_block] if length == 1 else [])
        for rule in rules:
            assert rule(tree, target_probs, torch.Generator().manual_seed(case)) == expected, (rule.__name__, case)
        greedy_target = torch.log(target_probs)
        longest = next((i for i, t in enumerate(tokens) if t != int(greedy_target[i].argmax())), length)
        assert verify_greedy(tree, greedy_target) == Verdict(list(range(longest)), int(greedy_target[longest].argmax()))


# --- each fixed draft's verdicts against their exact law ---------------------------------------------------------

VERDICT_DRAWS = 10_000


def exact_verdict_law(draft: Draft, target_probs: torch.Tensor) -> dict[tuple, float]:
    """{(accepted path, next token): probability} of multi-step speculative sampling on this fixed draft, by
    following every branch of the walk with its probability (float64): a child passes with min(1, p(x) / q(x)),
    where p is its parent's row less what the earlier siblings took; the next token follows the p left."""
    tokens, kids = draft.tokens.tolist(), children(draft.parents)
    law: Counter = Counter()

    def walk(node: int, accepted: tuple, weight: float) -> None:
        probs = target_probs[node + 1].double()
        for child in kids[node]:
            token = tokens[child]
            if draft.draft_probs is None:
                drawn_from = torch.zeros_like(probs)
                drawn_from[token] = 1.0
            else:
                drawn_from = draft.draft_probs[child].double()
            passes = min(1.0, float(probs[token] / drawn_from[token]))
            walk(child, accepted + (child,), weight * passes)
            weight *= 1.0 - passes
            leftover = (probs - drawn_from).clamp_min(0)
            probs = leftover / leftover.sum() if leftover.sum() > 0 else probs
        for token, mass in enumerate(probs.tolist()):
            if mass > 0:
                law[(accepted, token)] += weight * mass

    walk(ROOT, (), 1.0)
    return law


def verdict_distance(rule, draft: Draft, target_probs: torch.Tensor, seed: int) -> tuple[float, int]:
    """(total variation between the rule's verdicts over VERDICT_DRAWS runs and their exact law, the number of
    verdicts the law allows)."""
    law = exact_verdict_law(draft, target_probs)
    rng = torch.Generator().manual_seed(seed)
    counts = Counter()
    for _ in range(VERDICT_DRAWS):
        verdict = rule(draft, target_probs, rng)
        counts[(tuple(verdict.accepted), verdict.next_token)] += 1
    outcomes = set(law) | set(counts)
    return 0.5 * sum(abs(counts[o] / VERDICT_DRAWS - law[o]) for o in outcomes), len(law)


def fixed_drafts(synthetic) -> dict[str, tuple[Draft, torch.Tensor]]:
    """A chain and a tree of i.i.d. siblings, their tokens drawn from their rows, and a deterministic tree, each with
    its target rows. (Seeded so that the law of a rule forgetting the residual lies far from the right one: total
    variation 0.19 on the chain, 0.28 on the tree.)"""
    tables = torch.Generator().manual_seed(0)
    q = synthetic.random_distribution(tables, 9)
    rows = {"chain": (q[:3], torch.tensor([ROOT, 0, 1])),
            "tree": (torch.stack([q[0]] * 3 + [q[1]] * 2 + [q[2]] * 2 + [q[3]] * 2),
                     torch.tensor([ROOT, ROOT, ROOT, 0, 0, 1, 1, 2, 2]))}
    drafts = {name: Draft(torch.tensor([sample(row, tables) for row in draft_probs]), parents, draft_probs)
              for name, (draft_probs, parents) in rows.items()}
    drafts["deterministic"] = Draft(torch.tensor([4, 7, 1, 6]), torch.tensor([ROOT, ROOT, ROOT, 1]))
    return {name: (draft, synthetic.random_distribution(tables, len(draft) + 1)) for name, draft in drafts.items()}


@pytest.mark.parametrize("name", ["chain", "tree", "deterministic"])
@pytest.mark.parametrize("rule", [verify_speculative_sampling, verify_node_by_node])
def test_verdicts_follow_their_exact_law(synthetic, rule, name):
    draft, target_probs = fixed_drafts(synthetic)[name]
    distance, outcomes = verdict_distance(rule, draft, target_probs, seed=1)
    assert distance < synthetic.tv_bound(outcomes, VERDICT_DRAWS), (rule.__name__, name, distance)


def test_a_chain_is_verified_alike_without_replacement(synthetic):
    """No siblings, nothing removed: the rule for candidates drawn without replacement verifies a chain as the
    i.i.d. rule does."""
    draft, target_probs = fixed_drafts(synthetic)["chain"]
    distance, outcomes = verdict_distance(verify_without_replacement, draft, target_probs, seed=2)
    assert distance < synthetic.tv_bound(outcomes, VERDICT_DRAWS), distance


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_a_rule_that_forgets_the_residual_fails_the_same_test(synthetic, name):
    draft, target_probs = fixed_drafts(synthetic)[name]
    distance, outcomes = verdict_distance(forgets_the_residual, draft, target_probs, seed=1)
    assert distance > 2 * synthetic.tv_bound(outcomes, VERDICT_DRAWS), (name, distance)
