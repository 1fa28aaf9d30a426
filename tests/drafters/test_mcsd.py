"""Multi-candidate speculative decoding: candidates with and without replacement, lossless and exact."""

import pytest
import torch

from accelgen.drafters.draft_tree import DraftModelScorer, DraftTreeDrafter
from accelgen.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


def test_candidates_without_replacement_are_distinct(make_tiny_model):
    model = make_tiny_model("qwen2", seed=2, vocab_size=16)
    sampling = SamplingConfig(temperature=3.0)  # flat: with replacement, duplicates would be common
    drafter = DraftTreeDrafter(DraftModelScorer(model), sampling, torch.Generator().manual_seed(0), branching=[6],
                               replacement=False)
    for _ in range(20):
        tokens = drafter.propose(torch.tensor([1, 2, 3]), max_nodes=8).tokens.tolist()
        assert len(tokens) == 6 and len(set(tokens)) == 6


@pytest.mark.parametrize("replacement", [False, True])
def test_self_draft_is_lossless(tiny_target, tokenizer, assert_lossless, replacement):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "mcsd", 40,
                             draft_budget="method", draft_model=tiny_target, replacement=replacement)
    assert result.stats["accepted_per_step"][:4] == [4] * 4  # later, the node budget cuts the 28-node tree


def test_smollm_shallow_draft_is_lossless_with_partial_acceptance(smollm, smollm_shallow, assert_lossless):
    model, tokenizer = smollm
    result = assert_lossless(model, tokenizer, CHAT, "mcsd", 24, draft_budget="method", draft_model=smollm_shallow)
    assert 0 < result.stats["acceptance_rate"] < 1 and result.stats["mean_accepted_tokens"] > 1.0


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
@pytest.mark.parametrize("replacement", [False, True])
def test_sampling_keeps_the_target_distribution(assert_samples_target, sampling_draft, replacement):
    assert_samples_target("mcsd", [1, 3, 4],
                          draft_budget="method", draft_model=sampling_draft, branching=[3, 2], replacement=replacement)
