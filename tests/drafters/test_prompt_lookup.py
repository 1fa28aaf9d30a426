"""Prompt lookup decoding: the n-gram index, candidate lookup, and lossless generation."""

import time

import pytest
import torch

from accelgen.draft import ROOT
from accelgen.drafters.prompt_lookup import NGramIndex, PromptLookupDrafter, copy_continuation, lookup_candidates

pytestmark = pytest.mark.usefixtures("one_thread")


def indexed(tokens, min_n=1, max_n=3):
    index = NGramIndex(min_n, max_n)
    index.extend(tokens)
    return index


# --- data structures ---------------------------------------------------------------------------------------


def test_index_records_where_each_ngram_ends():
    index = indexed([7, 8, 7, 8, 9])
    assert index.occurrences((7, 8)) == [2, 4]
    assert index.occurrences((8,)) == [2, 4]
    assert index.occurrences((7, 8, 9)) == [5]
    assert index.occurrences((9, 7)) == []


def test_index_grows_incrementally_to_the_same_state():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 9, 1, 4]
    piecewise = NGramIndex(1, 3)
    for start in range(0, len(tokens), 3):
        piecewise.extend(tokens[start : start + 3])
    assert piecewise.ends == indexed(tokens).ends


def test_copy_continuation_repeats_a_period_past_the_end():
    assert copy_continuation([1, 2, 3, 4], 1, 2) == [2, 3]
    assert copy_continuation([5, 6, 5, 6], 2, 5) == [5, 6, 5, 6, 5]  # period 2, continued from the copy itself
    assert copy_continuation([9, 9, 9], 1, 4) == [9, 9, 9, 9]


def test_lookup_prefers_the_longest_ngram_then_the_most_recent_occurrence():
    #            0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3]
    index = indexed(tokens)
    # (2, 3) occurs ending at 3 and 7; the most recent earlier occurrence continues with 5 7 2 3 ...
    assert lookup_candidates(index, 3, 1) == [[5, 7, 2]]
    assert lookup_candidates(index, 3, 2) == [[5, 7, 2], [4, 9, 2]]
    index = indexed([1, 2, 3, 4, 8, 2, 3])  # the 3-gram (8, 2, 3) is new, the 2-gram (2, 3) is not
    assert lookup_candidates(index, 2, 1) == [[4, 8]]


def test_lookup_without_a_match_finds_nothing():
    assert lookup_candidates(indexed([1, 2, 3, 4, 5]), 4, 3) == []
    assert lookup_candidates(indexed([1, 2, 3, 4, 2, 6], min_n=2), 4, 1) == []  # only a 1-gram repeats


def test_branches_become_one_tree_from_the_root():
    drafter = PromptLookupDrafter(max_ngram=2, min_ngram=1, draft_length=3, branches=3)
    draft = drafter.propose(torch.tensor([1, 2, 3, 4, 2, 5, 6, 2, 7, 8, 2]), max_nodes=20)
    # continuations of the 1-gram 2, most recent first: [7 8 2], [5 6 2], [3 4 2]
    assert draft.tokens.tolist() == [7, 5, 3, 8, 6, 4, 2, 2, 2]
    assert draft.parents.tolist() == [ROOT, ROOT, ROOT, 0, 1, 2, 3, 4, 5]
    assert len(drafter.propose(torch.tensor([1, 2, 3, 4, 2, 5, 6, 2, 7, 8, 2]), max_nodes=4)) == 4


def test_no_match_drafts_nothing():
    assert len(PromptLookupDrafter().propose(torch.tensor([10, 11, 12, 13]), 10)) == 0


@pytest.mark.parametrize("options", [dict(min_ngram=0), dict(min_ngram=3, max_ngram=2), dict(draft_length=0),
                                     dict(branches=0)])
def test_bad_options_are_refused(options):
    with pytest.raises(ValueError):
        PromptLookupDrafter(**options)


def test_proposals_stay_cheap_on_a_long_context():
    """The index takes in only the new tokens of each step: a proposal must not rescan the 30k-token context."""
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, 500, (30_000,), generator=generator)
    drafter = PromptLookupDrafter(branches=2)
    drafter.propose(context, 10)  # indexes the prompt once
    started = time.perf_counter()
    for step in range(200):
        context = torch.cat([context, context[step * 7 : step * 7 + 2]])
        drafter.propose(context, 10)
    per_step = (time.perf_counter() - started) / 200
    assert per_step < 2e-3, f"{per_step * 1e3:.2f} ms per proposal"


# --- lossless generation -----------------------------------------------------------------------------------


def test_random_model_without_matches_decodes_one_token_per_step(tiny_target, tokenizer, assert_lossless):
    result = assert_lossless(tiny_target, tokenizer, [5, 17, 923, 4410, 77, 12], "pld", 30)
    assert result.stats["draft_tokens"] == 0
    assert result.stats["target_forwards"] == 30


@pytest.mark.parametrize("branches", [1, 3])
def test_cycle_in_the_prompt_is_copied(cycling_model, tokenizer, cycle_prompt, assert_lossless, branches):
    result = assert_lossless(cycling_model, tokenizer, cycle_prompt, "pld", 40, branches=branches, draft_length=6)
    assert result.stats["mean_accepted_tokens"] > 4


def test_copy_task_on_smollm_is_lossless_with_trees(smollm, copy_prompt, assert_lossless):
    model, tokenizer = smollm
    result = assert_lossless(model, tokenizer, copy_prompt, "pld", 40, branches=2)
    assert result.stats["mean_accepted_tokens"] > 2
    assert 0 < result.stats["acceptance_rate"] < 1  # partial acceptance along the way


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(assert_samples_target):
    assert_samples_target("pld", [1, 3, 4, 5, 3, 4, 5, 3, 4, 6, 3, 4], branches=2)


@pytest.mark.parametrize("max_new_tokens", [0, 1, 2, 5])
def test_drafts_never_overshoot_max_new_tokens(cycling_model, tokenizer, cycle_prompt, assert_lossless, max_new_tokens):
    result = assert_lossless(cycling_model, tokenizer, cycle_prompt, "pld", max_new_tokens, draft_length=10)
    assert len(result.token_ids) == max_new_tokens
