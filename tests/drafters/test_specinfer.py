"""SpecInfer: token trees from a draft model (static and dynamic), lossless greedy and exact sampling."""

import pytest
import torch

import accelgen
from accelgen.draft import ROOT
from accelgen.drafters.draft_tree import DraftModelScorer, DraftTreeDrafter, shape_from_branching, shape_from_paths
from accelgen.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


def test_static_tree_shape_and_draft_rows(tiny_target):
    drafter = DraftTreeDrafter(DraftModelScorer(tiny_target), SamplingConfig(1.0), torch.Generator().manual_seed(0),
                               branching=[2, 2, 1])
    draft = drafter.propose(torch.tensor(PROMPT), max_nodes=32)
    assert draft.parents.tolist() == [ROOT, ROOT, 0, 0, 1, 1, 2, 3, 4, 5]
    assert draft.draft_probs.shape == (10, tiny_target.config.vocab_size)
    assert torch.equal(draft.draft_probs[0], draft.draft_probs[1])  # siblings share the distribution they came from
    assert drafter.scorer.runner.length == len(PROMPT) + 6  # the nodes with children stay cached: 2 + 4
    assert len(drafter.propose(torch.tensor(PROMPT), max_nodes=3)) == 3  # the node budget cuts the tree


def test_scored_levels_stay_cached_and_match_a_plain_forward(tiny_target, assert_reordered):
    """Each level forwards only its own nodes, attending to their cached ancestors: the logits equal a causal
    forward of context + path. A node whose ancestors were never scored brings them along."""
    scorer = DraftModelScorer(tiny_target)
    tokens, parents = [3, 4, 5, 6], [ROOT, ROOT, 0, 1]  # a ─ c, b ─ d
    for first_level in ([0, 1], []):
        scorer.root_logits(PROMPT)
        if first_level:
            scorer.score(tokens, parents, first_level)
        logits = scorer.score(tokens, parents, [2, 3])
        assert scorer.runner.length == len(PROMPT) + 4
        for row, path in ((0, [3, 5]), (1, [4, 6])):
            expected = tiny_target(torch.tensor([PROMPT + path])).logits[0, -1].float()
            assert_reordered(logits[row], expected)
    scorer.root_logits(PROMPT + [3])  # the next proposal starts from the committed context
    assert scorer.runner.length == len(PROMPT) + 1 and scorer.cached_nodes == []


def test_tree_from_paths_ranks_children_by_draft_probability(tiny_target):
    paths = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    drafter = DraftTreeDrafter(DraftModelScorer(tiny_target), SamplingConfig(), None, paths=paths)
    draft = drafter.propose(torch.tensor(PROMPT), max_nodes=32)
    assert draft.parents.tolist() == [ROOT, ROOT, ROOT, 0, 0, 1, 3]
    first_logits = tiny_target(torch.tensor([PROMPT])).logits[0, -1]
    assert draft.tokens[:3].tolist() == torch.topk(first_logits, 3).indices.tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_paths_and_branching_give_the_same_tree(tiny_target, temperature):
    paths = [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0], [0, 1, 0], [1, 0, 0], [1, 1, 0]]
    assert shape_from_paths(paths) == shape_from_branching([2, 2, 1])
    drafts = [DraftTreeDrafter(DraftModelScorer(tiny_target), SamplingConfig(temperature), torch.Generator().manual_seed(4),
                               **shape)
              .propose(torch.tensor(PROMPT), max_nodes=32) for shape in ({"paths": paths}, {"branching": [2, 2, 1]})]
    assert torch.equal(drafts[0].tokens, drafts[1].tokens) and torch.equal(drafts[0].parents, drafts[1].parents)


def test_paths_tree_is_lossless(tiny_target, tokenizer, assert_lossless):
    paths = [[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "specinfer", 30,
                             draft_budget="method", draft_model=tiny_target, paths=paths)
    assert result.stats["accepted_per_step"][:3] == [4] * 3  # the top-1 path [0, 0, 0, 0] is always accepted


@pytest.mark.parametrize("paths, problem", [([[0, 0]], "prefix"), ([[0], [2]], "without gaps"),
                                            ([[0], []], "non-empty"), ([["a"]], "lists of child ranks")])
def test_bad_paths_are_named(paths, problem):
    with pytest.raises(ValueError, match=problem):
        shape_from_paths(paths)


def test_dynamic_tree_keeps_the_most_probable_nodes(tiny_target):
    drafter = DraftTreeDrafter(DraftModelScorer(tiny_target), SamplingConfig(), None, width=3, depth=4, max_nodes=10)
    draft = drafter.propose(torch.tensor(PROMPT), max_nodes=32)
    assert len(draft) == 10 and (draft.parents < torch.arange(10)).all()


def test_self_draft_is_lossless_and_accepts_whole_paths(tiny_target, tokenizer, assert_lossless):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "specinfer", 40,
                             draft_budget="method", draft_model=tiny_target)
    # the top-1 path is in every tree; near max_new_tokens the node budget leaves only shallow trees
    assert result.stats["accepted_per_step"][:5] == [4] * 5


def test_dynamic_self_draft_is_lossless(tiny_target, tokenizer, assert_lossless):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "specinfer", 40,
                             draft_budget="method", draft_model=tiny_target, dynamic=True)
    # the random model's flat distributions let deep siblings outrank the top-1 path now and then
    assert result.stats["mean_accepted_tokens"] > 2.0


def test_random_draft_is_lossless(tiny_target, tiny_draft, tokenizer, assert_lossless):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "specinfer", 30, draft_model=tiny_draft)
    assert result.stats["accepted_draft_tokens"] == 0


@pytest.mark.parametrize("options", [{"branching": [3, 2, 1, 1]}, {"dynamic": True, "max_nodes": 12}])
def test_smollm_shallow_draft_is_lossless_with_partial_acceptance(smollm, smollm_shallow, assert_lossless, options):
    model, tokenizer = smollm
    result = assert_lossless(model, tokenizer, CHAT, "specinfer", 24,
                             draft_budget="method", draft_model=smollm_shallow, **options)
    assert 0 < result.stats["acceptance_rate"] < 1 and result.stats["mean_accepted_tokens"] > 1.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_width_one_tree_is_speculative_decoding(tiny_target, tiny_draft, tokenizer, temperature):
    """branching [1, 1, 1, 1] drafts and verifies exactly what `speculative` with gamma 4 does: same seed, same run."""
    runs = [accelgen.generate(tiny_target, tokenizer, PROMPT, method=method, draft_model=draft, max_new_tokens=24,
                              temperature=temperature, seed=3, **options)
            for draft in (tiny_target, tiny_draft)
            for method, options in [("specinfer", {"branching": [1] * 4, "draft_budget": "method"}),
                                    ("speculative", {"gamma": 4})]]
    for tree, chain in (runs[:2], runs[2:]):
        assert tree.token_ids == chain.token_ids
        assert tree.stats["accepted_per_step"] == chain.stats["accepted_per_step"]


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(assert_samples_target, sampling_draft):
    assert_samples_target("specinfer", [1, 3, 4], draft_budget="method", draft_model=sampling_draft, branching=[2, 2])


def test_clear_errors(tiny_target, tokenizer):
    with pytest.raises(ValueError, match="branching"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="specinfer", draft_model=tiny_target, branching=[2, 0])
    with pytest.raises(ValueError, match="dynamic tree"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="specinfer", draft_model=tiny_target, dynamic=True,
                          width=0)
