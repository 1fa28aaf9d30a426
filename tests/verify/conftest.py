"""Shared by the statistical verifier tests: synthetic two-level draft trees and the law of what they commit.

The bound on total variation is derived from the sample size (see test_sampling.py): E[TV] <= 0.5 * sqrt(V / N)
and TV concentrates within sqrt(ln(1/delta) / (2N)) of its mean, so a correct rule exceeds it with probability
below delta = 1e-6.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from accelgen.draft import ROOT, Draft
from accelgen.sampling import sample

VOCAB = 12


def tv_bound(categories: int, draws: int, delta: float = 1e-6) -> float:
    return 0.5 * math.sqrt(categories / draws) + math.sqrt(math.log(1 / delta) / (2 * draws))


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def random_distribution(generator, *shape, sharpness=2.0) -> torch.Tensor:
    return torch.softmax(sharpness * torch.randn(*shape, VOCAB, generator=generator), dim=-1)


def draw_with_replacement(draft_probs: torch.Tensor, count: int, rng) -> list[int]:
    return [sample(draft_probs, rng) for _ in range(count)]


def draw_without_replacement(draft_probs: torch.Tensor, count: int, rng) -> list[int]:
    left, drawn = draft_probs.clone(), []
    for _ in range(count):
        drawn.append(sample(left / left.sum(), rng))
        left[drawn[-1]] = 0.0
    return drawn


def two_level_tree(branching, draw, draft_first, draft_next, rng) -> Draft:
    """A tree of branching[0] children of the root, each with branching[1] children, drawn by `draw`;
    draft_probs row i = the draft distribution at node i's parent."""
    tokens, parents, rows = [], [], []
    for token in draw(draft_first, branching[0], rng):
        tokens.append(token), parents.append(ROOT), rows.append(draft_first)
    for parent in range(branching[0]):
        for token in draw(draft_next[tokens[parent]], branching[1], rng):
            tokens.append(token), parents.append(parent), rows.append(draft_next[tokens[parent]])
    return Draft(torch.tensor(tokens), torch.tensor(parents), torch.stack(rows))


def first_two_tokens(verifier, branching, draw, seed, draws, sharpness=2.0):
    """first_two_tokens(verifier, branching, draw, seed, draws, sharpness) -> (counts, exact), both (VOCAB * VOCAB,):
    how often each pair of first two committed tokens came out, and the target's exact law of that pair
    (sharpness: of the random target and draft tables; higher is more peaked).

    Target: first token ~ target_first, second ~ target_next[first]; the draft has its own tables. When a
    step commits one token, the second comes from the next step, which samples the target directly."""

    tables = torch.Generator().manual_seed(seed)
    target_first, draft_first = random_distribution(tables, sharpness=sharpness), random_distribution(tables, sharpness=sharpness)
    target_next = random_distribution(tables, VOCAB, sharpness=sharpness)
    draft_next = random_distribution(tables, VOCAB, sharpness=sharpness)
    target_bonus = random_distribution(tables)
    rng = torch.Generator().manual_seed(seed + 1)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(draws):
        draft = two_level_tree(branching, draw, draft_first, draft_next, rng)
        depth_one = draft.parents == ROOT
        target_probs = torch.stack([target_first] + [target_next[t] if first else target_bonus
                                                     for t, first in zip(draft.tokens.tolist(), depth_one.tolist())])
        committed = verifier(draft, target_probs, rng).new_tokens(draft)
        if len(committed) == 1:
            committed.append(sample(target_next[committed[0]], rng))
        counts[committed[0], committed[1]] += 1
    return counts.flatten(), (target_first[:, None] * target_next).flatten()


@pytest.fixture(scope="session")
def synthetic():
    """The helpers above, for test modules (importlib import mode: no `from conftest import`)."""
    return SimpleNamespace(VOCAB=VOCAB, tv_bound=tv_bound, total_variation=total_variation,
                           random_distribution=random_distribution, draw_with_replacement=draw_with_replacement,
                           draw_without_replacement=draw_without_replacement, two_level_tree=two_level_tree,
                           first_two_tokens=first_two_tokens)
