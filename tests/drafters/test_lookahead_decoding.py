"""Lookahead decoding: the n-gram pool, the 2-D window as tree nodes, its Jacobi update, lossless generation."""

import pytest
import torch

from accelgen.draft import ROOT, Verdict, depths
from accelgen.drafters.lookahead_decoding import LookaheadDecodingDrafter, NGramPool, lookahead_nodes, spread

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]


def one_hot_logits(tokens, vocab=64):
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


# --- n-gram pool -------------------------------------------------------------------------------------------


def test_pool_keeps_the_most_recent_ngrams_per_first_token():
    pool = NGramPool(per_key=2)
    for ngram in [(1, 2, 3), (1, 4, 5), (1, 2, 3), (1, 6, 7), (8, 9, 9)]:
        pool.add(ngram)
    assert pool.candidates(1) == [(6, 7), (2, 3)]  # (4, 5) was the least recently added
    assert pool.candidates(8) == [(9, 9)] and pool.candidates(2) == []
    empty = NGramPool(per_key=0)
    empty.add((1, 2))
    assert empty.candidates(1) == []


# --- the window as draft nodes -----------------------------------------------------------------------------


def test_window_nodes_attend_to_the_guesses_before_their_position():
    levels = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]  # level l, column i guesses position i + l + 1
    tokens, parents, deepest = lookahead_nodes(levels, offset=0)
    assert tokens == [10, 11, 12, 20, 30, 21, 31, 22, 32]
    assert parents == [ROOT, 0, 1, 0, 3, 1, 5, 2, 7]
    assert deepest == [4, 6, 8]
    position = dict(zip(tokens, depths(torch.tensor(parents)).tolist()))
    assert all(position[10 * (level + 1) + column] == column + level + 1 for level in range(3) for column in range(3))
    shifted = lookahead_nodes(levels, offset=5)[1]
    assert shifted[:3] == [ROOT, 5, 6] and shifted[3] == 5


def test_spread_copies_tokens_evenly():
    assert spread([1, 2, 3, 4, 5, 6], 3) == [1, 3, 5]
    assert spread([7], 3) == [7, 7, 7]


# --- the drafter -------------------------------------------------------------------------------------------


def test_window_warms_up_then_shifts_and_feeds_the_pool():
    drafter = LookaheadDecodingDrafter(window_size=2, ngram_size=3, guess_set_size=4)
    context = torch.tensor([1, 2, 3, 4, 5, 6])
    draft = drafter.propose(context, 50)  # spine of window + ngram - 2 = 3 columns, one level
    assert drafter.levels == [[1, 3, 5]] and draft.tokens.tolist()[-3:] == [1, 3, 5]
    drafter.update(draft, Verdict([], 40), one_hot_logits([40] + [0] * (len(draft) - 3) + [41, 42, 43]))
    assert drafter.levels == [[3, 5], [42, 43]]  # warm-up: a level more, a column less
    draft = drafter.propose(torch.cat([context, torch.tensor([40])]), 50)
    assert drafter.pool.candidates(40) == []  # no 3-gram from 40 yet
    rows = [0] * (len(draft) + 1)
    rows[-2], rows[-1] = 50, 51  # after the deepest nodes, 42 and 43: the draft ends [... 3 5 42 43]
    drafter.update(draft, Verdict([], 40), one_hot_logits(rows))
    # column n-grams (3 42 50) and (5 43 51), pooled after the prompt's and committed text's own 3-grams
    assert drafter.pool.candidates(3) == [(42, 50), (4, 5)] and drafter.pool.candidates(5) == [(43, 51), (6, 40)]
    assert drafter.levels == [[42, 43], [50, 51]]  # steady state: levels shift up, new guesses at the bottom


def test_pool_candidates_for_the_root_come_before_the_window():
    drafter = LookaheadDecodingDrafter(window_size=2, ngram_size=3, guess_set_size=3)
    draft = drafter.propose(torch.tensor([1, 2, 3, 1, 2, 4, 1]), 50)  # prompt 3-grams from 1: (2, 3), (2, 4)
    assert draft.tokens.tolist()[:3] == [2, 4, 3] and draft.parents.tolist()[:3] == [ROOT, 0, 0]
    assert len(draft) == 3 + 3  # then the spine of 3 columns


def test_window_is_left_out_when_it_does_not_fit():
    drafter = LookaheadDecodingDrafter(window_size=4, ngram_size=3)
    draft = drafter.propose(torch.tensor([1, 2, 3, 1]), 3)
    assert draft.tokens.tolist() == [2, 3]  # only the pooled 3-gram (1, 2, 3)
    levels = [list(level) for level in drafter.levels]
    drafter.update(draft, Verdict([0, 1], 9), one_hot_logits([2, 3, 9]))
    assert drafter.levels == levels


@pytest.mark.parametrize("options", [dict(window_size=0), dict(ngram_size=1), dict(guess_set_size=-1)])
def test_bad_options_are_refused(options):
    with pytest.raises(ValueError):
        LookaheadDecodingDrafter(**options)


# --- lossless generation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, dict(window_size=5, ngram_size=4, guess_set_size=5)])  # default; the paper's
def test_random_model_is_lossless(tiny_target, tokenizer, assert_lossless, options):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "lookahead-decoding", 30, **options)
    assert result.stats["draft_tokens"] > 0


def test_cycle_is_found_by_the_pool(cycling_model, tokenizer, cycle_prompt, assert_lossless):
    result = assert_lossless(cycling_model, tokenizer, cycle_prompt, "lookahead-decoding", 40)
    assert result.stats["mean_accepted_tokens"] > 2.5


def test_accepted_window_nodes_are_still_exact(make_tiny_model, tokenizer, assert_lossless):
    """Without pool candidates every draft node is a window guess; where the window converged (a model stuck
    on one token) greedy verification accepts its nodes, and the output is still greedy decoding's."""
    model = make_tiny_model("qwen2", seed=0, vocab_size=256)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    result = assert_lossless(model, tokenizer, [5, 17, 23, 41, 7, 12], "lookahead-decoding", 30, guess_set_size=0)
    assert result.stats["accepted_draft_tokens"] > 0


def test_copy_task_on_smollm(smollm, copy_prompt, assert_lossless):
    model, tokenizer = smollm
    result = assert_lossless(model, tokenizer, copy_prompt, "lookahead-decoding", 40)
    assert result.stats["mean_accepted_tokens"] > 1.5


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(assert_samples_target):
    assert_samples_target("lookahead-decoding", [1, 3, 4, 5, 3, 4, 6, 3, 4], window_size=2, ngram_size=3)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5])
def test_short_generations_skip_the_window(cycling_model, tokenizer, cycle_prompt, assert_lossless, max_new_tokens):
    result = assert_lossless(cycling_model, tokenizer, cycle_prompt, "lookahead-decoding", max_new_tokens)
    assert len(result.token_ids) == max_new_tokens
