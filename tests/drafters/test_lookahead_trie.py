"""Lookahead's global trie: branch inserting, eliminating, node pruning, multi-stage retrieval; lossless generation."""

import gc

import pytest
import torch

from accelgen.draft import ROOT
from accelgen.drafters.lookahead_trie import LookaheadTrie, TrieLookaheadDrafter, best_branches

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]


def paths(trie, request=None):
    """Every root-to-node path with its (output count, this request's prompt count)."""
    found, stack = {}, [((), trie.root)]
    while stack:
        prefix, node = stack.pop()
        for token, child in node.children.items():
            path = prefix + (token,)
            found[path] = (child.output_count, (child.prompt_counts or {}).get(request, 0))
            stack.append((path, child))
    return found


# --- branch inserting --------------------------------------------------------------------------------------


def test_every_window_of_the_prompt_is_a_counted_path():
    trie = LookaheadTrie(depth=3)
    request = trie.open_request([1, 2, 1, 2])
    assert paths(trie, request) == {
        (1,): (0, 2), (1, 2): (0, 2), (1, 2, 1): (0, 1),
        (2,): (0, 2), (2, 1): (0, 1), (2, 1, 2): (0, 1),
    }
    assert trie.size == 6


def test_output_inserted_step_by_step_counts_like_all_at_once():
    tokens = [4, 5, 4, 5, 6, 4, 5, 6]
    whole = LookaheadTrie(depth=4)
    whole.insert_output(tokens, len(tokens))
    stepwise = LookaheadTrie(depth=4)
    seen = []
    for chunk in ([4, 5], [4], [5, 6, 4], [5, 6]):
        stepwise.insert_output(seen[-3:] + chunk, len(chunk))  # the committed tail, then the new tokens
        seen += chunk
    assert paths(stepwise) == paths(whole) and stepwise.size == whole.size


# --- branch eliminating ------------------------------------------------------------------------------------


def test_eliminating_a_prompt_keeps_only_what_outputs_also_inserted():
    trie = LookaheadTrie(depth=3)
    request = trie.open_request([1, 2, 3])
    trie.insert_output([7, 1, 2], 3)
    trie.eliminate(request)
    assert paths(trie) == {(7,): (1, 0), (7, 1): (1, 0), (7, 1, 2): (1, 0), (1,): (1, 0), (1, 2): (1, 0), (2,): (1, 0)}
    assert trie.size == 6
    trie.eliminate(request)  # idempotent
    assert trie.size == 6


def test_another_requests_prompt_is_invisible():
    trie = LookaheadTrie(depth=4)
    mine, other = trie.open_request([1, 2, 3]), trie.open_request([1, 2, 9])
    draft = trie.retrieve([1, 2], mine, max_nodes=8, branch_length=2, max_prefix=2, prompt_boost=10)
    assert draft.tokens.tolist() == [3]
    trie.eliminate(mine)
    assert trie.node_at([1, 2, 3], other) is None and trie.node_at([1, 2, 9], other) is not None


# --- node pruning ------------------------------------------------------------------------------------------


def test_pruning_halves_counts_and_drops_rare_branches():
    trie = LookaheadTrie(depth=2)
    trie.insert_output([1, 2, 1, 2, 1, 2, 3, 4], 8)
    assert paths(trie)[(1, 2)] == (3, 0) and (3, 4) in paths(trie)
    trie.prune()
    assert paths(trie) == {(1,): (1, 0), (1, 2): (1, 0), (2,): (1, 0), (2, 1): (1, 0)}
    assert trie.size == 4


def test_a_full_trie_prunes_itself_but_keeps_live_prompts():
    trie = LookaheadTrie(depth=3, capacity=10)
    request = trie.open_request([1, 2, 3, 4, 5])
    assert trie.size == 12  # the prompt alone exceeds the capacity: live prompt branches are never pruned
    trie.insert_output(list(range(100, 120)), 20)  # 57 output nodes, each seen once: pruned at once
    assert trie.size == len(paths(trie)) == 12
    assert trie.node_at([1, 2, 3], request) is not None and trie.node_at([100]) is None


# --- retrieval ---------------------------------------------------------------------------------------------


def test_retrieval_uses_the_longest_prefix_with_enough_branches():
    trie = LookaheadTrie(depth=6)
    trie.insert_output([1, 2, 3, 4, 5, 6, 9, 2, 3, 8], 10)
    # prefix "1 2 3" knows one 3-token branch (4 5 6): enough for branch_length 3
    draft = trie.retrieve([1, 2, 3], None, max_nodes=10, branch_length=3, max_prefix=3, prompt_boost=1)
    assert draft.tokens.tolist() == [4, 5, 6]
    # "0 2 3" is unknown; "2 3" has two branches (4 5 6 9 and 8), which beats "3" alone
    draft = trie.retrieve([0, 2, 3], None, max_nodes=10, branch_length=3, max_prefix=3, prompt_boost=1)
    assert sorted(draft.tokens.tolist()) == [4, 5, 6, 8]
    assert len(trie.retrieve([0, 0, 42], None, max_nodes=10, branch_length=3, max_prefix=3, prompt_boost=1)) == 0


def test_prompt_branches_come_first():
    trie = LookaheadTrie(depth=3)
    for _ in range(5):
        trie.insert_output([1, 8, 8], 3)
    request = trie.open_request([1, 2, 2])
    boosted = trie.retrieve([1], request, max_nodes=2, branch_length=2, max_prefix=1, prompt_boost=100)
    assert boosted.tokens.tolist() == [2, 2]
    plain = trie.retrieve([1], request, max_nodes=2, branch_length=2, max_prefix=1, prompt_boost=1)
    assert plain.tokens.tolist() == [8, 8]


def test_best_branches_is_a_tree_within_budget_heaviest_first():
    trie = LookaheadTrie(depth=4)
    for tokens, times in (([0, 1, 2, 3], 3), ([0, 1, 4], 2), ([0, 5], 1)):
        for _ in range(times):
            trie.insert_output(tokens, len(tokens))
    # below 0: 1 (5 windows) ─ 2 (3) ─ 3 (3)
    #                        └ 4 (2)
    #            5 (1)
    draft = best_branches(trie.node_at([0]), None, max_nodes=4, max_depth=3, prompt_boost=1)
    assert draft.tokens.tolist() == [1, 2, 3, 4]
    assert draft.parents.tolist() == [ROOT, 0, 1, 0]
    assert best_branches(trie.node_at([0]), None, max_nodes=9, max_depth=2, prompt_boost=1).tokens.tolist() == [1, 2, 4, 5]


# --- drafter -----------------------------------------------------------------------------------------------


def test_drafter_errors():
    with pytest.raises(TypeError):
        TrieLookaheadDrafter({}, 100)
    with pytest.raises(ValueError):
        TrieLookaheadDrafter(None, 100, branch_length=0)
    trie = LookaheadTrie()
    TrieLookaheadDrafter(trie, 100)
    with pytest.raises(ValueError, match="vocabulary"):
        TrieLookaheadDrafter(trie, 200)


def test_closing_a_request_eliminates_its_prompt():
    trie = LookaheadTrie(depth=4)
    drafter = TrieLookaheadDrafter(trie, 100, branch_length=2, max_prefix=2)
    drafter.propose(torch.tensor([1, 2, 3, 1, 2]), 8)
    drafter.propose(torch.tensor([1, 2, 3, 1, 2, 3, 7]), 8)
    assert trie.node_at([1, 2, 3], drafter.request).prompt_counts
    del drafter
    gc.collect()
    assert not trie._prompts and all(prompt == 0 for _, prompt in paths(trie).values())
    assert (3, 7) in paths(trie)  # the output stays


# --- lossless generation -----------------------------------------------------------------------------------


def test_random_model_without_repeats_decodes_one_token_per_step(tiny_target, tokenizer, assert_lossless):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "trie-lookahead", 20)
    assert result.stats["draft_tokens"] == 0 and result.stats["target_forwards"] == 20


def test_cycle_in_the_prompt_is_drafted(cycling_model, tokenizer, cycle_prompt, assert_lossless):
    result = assert_lossless(cycling_model, tokenizer, cycle_prompt, "trie-lookahead", 40)
    assert result.stats["mean_accepted_tokens"] > 4


def test_a_shared_trie_reuses_earlier_answers(tiny_target, tokenizer, assert_lossless):
    trie = LookaheadTrie()
    first = assert_lossless(tiny_target, tokenizer, PROMPT, "trie-lookahead", 40, trie=trie)
    assert first.stats["draft_tokens"] == 0
    again = assert_lossless(tiny_target, tokenizer, PROMPT, "trie-lookahead", 40, trie=trie, max_nodes=12)
    assert again.stats["mean_accepted_tokens"] > 4
    assert not trie._prompts  # both requests ended: their prompt branches were eliminated


def test_copy_task_on_smollm(smollm, copy_prompt, assert_lossless):
    model, tokenizer = smollm
    result = assert_lossless(model, tokenizer, copy_prompt, "trie-lookahead", 40)
    assert result.stats["mean_accepted_tokens"] > 2
    assert result.stats["draft_tokens"] > result.stats["accepted_draft_tokens"]


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(assert_samples_target):
    assert_samples_target("trie-lookahead", [1, 3, 4, 5, 3, 4, 6, 3, 4, 5, 7, 4])
