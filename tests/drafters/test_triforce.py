"""TriForce: the target over a retrieved part of its own KV cache drafts, a small model with a StreamingLLM
cache drafts for it; lossless greedy and exact sampling, whatever the retrieval keeps."""

import pytest
import torch

from accelgen import cache as kv
from accelgen.drafters.triforce import StreamingProposer, chunk_scores, retrieved_positions
from accelgen.loop import Sequence, _steps

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]
LONG_PROMPT = [(37 * i) % 5000 + 100 for i in range(120)]
RETRIEVAL = dict(budget=32, chunk_size=8, sink=2, window=16, gamma=4, stage_two_tokens=2)


def test_chunks_are_scored_by_the_query_against_their_mean_key():
    keys = torch.randn(1, 32, 4) * 0.01  # one key head, 32 positions, 4 chunks of 8
    direction = torch.tensor([1.0, -1.0, 0.5, 2.0])
    keys[0, 16:24] += direction
    query = torch.stack([direction, direction])  # two query heads share the key head
    scores = chunk_scores(query, keys, chunk_size=8)
    assert scores.shape == (4,) and int(scores.argmax()) == 2
    positions = retrieved_positions(scores, chunk_size=8, budget=8, prompt=35)
    assert positions.tolist() == list(range(16, 24)) + [32, 33, 34]  # the best chunk, then the incomplete last one


def run(model, tokenizer, prompt, max_new_tokens, **options):
    sequence = Sequence.start(model, tokenizer, prompt, method="triforce", max_new_tokens=max_new_tokens, **options)
    steps = _steps(sequence)
    try:
        while True:
            next(steps)
    except StopIteration as stop:
        return sequence, stop.value


def test_retrieval_keeps_the_budget_of_a_long_prompt_and_stays_lossless(tiny_target, tiny_draft, tokenizer, greedy):
    sequence, result = run(tiny_target, tokenizer, LONG_PROMPT, 24, draft_model=tiny_draft, **RETRIEVAL)
    assert result.token_ids == greedy(tiny_target, tokenizer, LONG_PROMPT, 24).token_ids
    drafter = sequence.drafter
    assert [len(kept) for kept in drafter.retrieved] == [32, 32]  # 4 chunks of 8 of the 120 prompt positions
    assert drafter.middle.runner.position_offset == len(LONG_PROMPT) - 32
    streaming = drafter.middle.cheap.runner
    assert kv.cache_length(streaming.cache) <= 2 + 16 and streaming.position_offset > 0  # sink + window


def test_a_budget_that_holds_the_prompt_makes_the_middle_level_the_target(tiny_target, tokenizer, assert_lossless):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "triforce", 25, draft_model=tiny_target, gamma=4)
    assert result.stats["accepted_per_step"][1:4] == [4, 4, 4]  # the first step only reads the prompt


def test_random_small_model_is_lossless(tiny_target, tiny_draft, tokenizer, assert_lossless):
    assert_lossless(tiny_target, tokenizer, LONG_PROMPT, "triforce", 20, draft_model=tiny_draft, **RETRIEVAL)


def test_smollm_with_partial_acceptance(smollm, smollm_26_layers, copy_prompt, assert_lossless):
    model, tokenizer = smollm
    result = assert_lossless(model, tokenizer, copy_prompt, "triforce", 16,
                             draft_budget="method", draft_model=smollm_26_layers,
                             budget=32, chunk_size=8, window=32)
    assert result.stats["mean_accepted_tokens"] > 1.3


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3])
def test_max_new_tokens_smaller_than_a_draft(tiny_target, tokenizer, assert_lossless, max_new_tokens):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "triforce", max_new_tokens, draft_model=tiny_target,
                             gamma=6)
    assert len(result.token_ids) == max_new_tokens


def test_streaming_proposer_is_the_small_models_greedy_chain_while_the_window_holds_everything(tiny_draft, greedy,
                                                                                             tokenizer):
    proposer = StreamingProposer(tiny_draft, sink=4, window=1000)
    assert proposer.propose(PROMPT, 5) == greedy(tiny_draft, tokenizer, PROMPT, 5).token_ids
    evicting = StreamingProposer(tiny_draft, sink=2, window=8)
    evicting.propose(LONG_PROMPT[:40], 3)
    assert kv.cache_length(evicting.runner.cache) == 10 and evicting.runner.length == 42
    evicting.propose(LONG_PROMPT[:30], 3)  # parts inside the evicted positions: starts over
    assert evicting.runner.length == 10 + (30 + 2 - 10)


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(assert_samples_target, sampling_draft):
    prompt = [(5 * i + 1) % 8 for i in range(40)]
    assert_samples_target("triforce", prompt, draft_model=sampling_draft, budget=8, chunk_size=4, window=8, gamma=2,
                          stage_two_tokens=1)


def test_bad_options_name_the_problem(tiny_target, tokenizer):
    with pytest.raises(ValueError, match="budget must be >= 16"):
        Sequence.start(tiny_target, tokenizer, PROMPT, method="triforce", draft_model=tiny_target, budget=8,
                       chunk_size=16)
    with pytest.raises(ValueError, match="needs a draft model"):
        Sequence.start(tiny_target, tokenizer, PROMPT, method="triforce")
