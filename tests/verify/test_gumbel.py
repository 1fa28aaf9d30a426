"""Seeded per-position sampling (Gumbel-max coupling) commits exactly the target's law, whatever drafted; a rule
that reads the wrong position's noise fails the same test."""

import itertools

import pytest
import torch

from accelgen.draft import Draft, depths
from accelgen.sampling import PositionNoise, SamplingConfig, gumbel_choice
from accelgen.verify import verify_gumbel

DRAWS = 20_000
FIRST_POSITION = 10  # the absolute position of the first committed token (any)


@pytest.fixture(autouse=True)
def single_thread():
    """12-token distributions: a second thread only adds synchronisation, milliseconds per op on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def per_position_verifier(coupled_draft: bool = False):
    """verify(draft, target_probs, rng) for the synthetic tests, a fresh seed per call (one request each).
    coupled_draft: the draft redrawn as a draft model using the same noise would propose it."""
    seeds = itertools.count()

    def verify(draft: Draft, target_probs: torch.Tensor, rng):
        sampling = SamplingConfig(temperature=1.0, noise=PositionNoise(next(seeds), target_probs.shape[-1]))
        if coupled_draft:
            draft = coupled(draft, sampling.noise)
        return verify_gumbel(draft, target_probs.log(), sampling, first_position=FIRST_POSITION)

    return verify


def coupled(draft: Draft, noise: PositionNoise) -> Draft:
    """The draft's tokens redrawn from their own draft distributions with the noise of their positions."""
    positions = (FIRST_POSITION + depths(draft.parents) - 1).tolist()  # node i sits depth(i) - 1 past the first
    return Draft(gumbel_choice(draft.draft_probs, noise.rows(positions)), draft.parents, draft.draft_probs)


@pytest.mark.parametrize("branching, coupled_draft", [([1, 1], True), ([3, 2], False)])
def test_per_position_noise_reproduces_the_target(synthetic, branching, coupled_draft):
    counts, exact = synthetic.first_two_tokens(per_position_verifier(coupled_draft), branching,
                                               synthetic.draw_with_replacement, seed=0, draws=DRAWS)
    assert synthetic.total_variation(counts, exact) < synthetic.tv_bound(synthetic.VOCAB ** 2, DRAWS)


class OnePositionNoise(PositionNoise):
    """A wrong rule's noise: every position reads the first position's (as if rows ignored their depth)."""

    def rows(self, positions: list[int], like: torch.Tensor | None = None) -> torch.Tensor:
        return super().rows([FIRST_POSITION] * len(positions), like)


def two_positions_law(synthetic, noise_kind) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tokens chosen by verify_gumbel, one request per seed: the first with no draft, the second after a
    draft holding the first (always accepted: it is the target's own choice)."""
    tables = torch.Generator().manual_seed(0)
    first = synthetic.random_distribution(tables)
    following = synthetic.random_distribution(tables, synthetic.VOCAB)
    counts = torch.zeros(synthetic.VOCAB, synthetic.VOCAB)
    for seed in range(DRAWS):
        sampling = SamplingConfig(temperature=1.0, noise=noise_kind(seed, synthetic.VOCAB))
        token = verify_gumbel(Draft.empty(), first.log()[None], sampling, FIRST_POSITION).next_token
        rows = torch.stack([first, following[token]]).log()
        verdict = verify_gumbel(Draft.chain(torch.tensor([token])), rows, sampling, FIRST_POSITION)
        assert verdict.accepted == [0]
        counts[token, verdict.next_token] += 1
    return counts.flatten(), (first[:, None] * following).flatten()


@pytest.mark.parametrize("noise_kind, right", [(PositionNoise, True), (OnePositionNoise, False)])
def test_reading_the_wrong_positions_noise_fails_the_test(synthetic, noise_kind, right):
    counts, exact = two_positions_law(synthetic, noise_kind)
    within = synthetic.total_variation(counts, exact) < synthetic.tv_bound(synthetic.VOCAB ** 2, DRAWS)
    assert within == right


def test_a_coupled_draft_is_accepted_where_the_models_agree():
    target = torch.log_softmax(torch.randn(3, 12, generator=torch.Generator().manual_seed(0)), dim=-1)
    noise = PositionNoise(5, 12)
    sampling = SamplingConfig(temperature=1.0, noise=noise)
    choices = gumbel_choice(target.exp(), noise.rows([4, 5, 6])).tolist()
    draft = Draft.chain(torch.tensor(choices[:2]))  # what a draft model equal to the target would propose
    verdict = verify_gumbel(draft, target, sampling, first_position=4)
    assert verdict.accepted == [0, 1] and verdict.next_token == choices[2]
