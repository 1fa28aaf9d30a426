"""REST: suffix array, datastore lookups, the frequency trie, and lossless generation."""

import json
import shutil
import time

import numpy as np
import pytest
import torch

from accelgen.atomic import CorruptFileError
from accelgen.draft import ROOT
from accelgen.drafters.rest import (
    SEPARATOR,
    Datastore,
    RestDrafter,
    build_datastore,
    build_suffix_array,
    open_datastore,
    write_datastore,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]


def suffixes_by_brute_force(tokens, depth=None):
    return sorted(range(len(tokens)), key=lambda i: tokens[i : i + depth if depth else None].tolist())


# --- suffix array ------------------------------------------------------------------------------------------


def test_suffix_array_of_a_small_example():
    assert build_suffix_array(np.array([2, 1, 2, 1])).tolist() == [3, 1, 2, 0]  # a, aba, ba, baba
    assert build_suffix_array(np.zeros(0, dtype=np.int32)).tolist() == []


@pytest.mark.parametrize("seed", range(5))
def test_suffix_array_matches_sorting_every_suffix(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(-1, 3, size=300).astype(np.int32)  # few symbols: long repeats; -1 = text separator
    suffixes = build_suffix_array(tokens)
    assert [tokens[i:].tolist() for i in suffixes] == [tokens[i:].tolist() for i in suffixes_by_brute_force(tokens)]


def test_suffix_array_orders_ids_as_numbers_whatever_their_width():
    """Ids past 2^16 (a 151k vocabulary) and past 2^24 sort by value, the separator first, not by their bytes."""
    rng = np.random.default_rng(0)
    symbols = np.array([SEPARATOR, 3, 255, 256, 65535, 65536, 151_000, 2**24 + 1], dtype=np.int32)
    tokens = symbols[rng.integers(0, len(symbols), size=400)]
    suffixes = build_suffix_array(tokens)
    assert [tokens[i:].tolist() for i in suffixes] == [tokens[i:].tolist() for i in suffixes_by_brute_force(tokens)]


# --- datastore ---------------------------------------------------------------------------------------------


@pytest.fixture
def small_store(tmp_path):
    # "1 2 3" is followed by 4 three times and by 5 once
    write_datastore([[1, 2, 3, 4, 6], [7, 1, 2, 3, 4], [1, 2, 3, 5], [9, 2, 3, 4, 8], [1]], tmp_path, progress=False)
    return Datastore(tmp_path)


def test_datastore_files_and_description(small_store):
    assert small_store.meta["texts"] == 5 and small_store.meta["tokens"] == 20 and small_store.meta["max_token_id"] == 9
    assert small_store.tokens.tolist()[:6] == [1, 2, 3, 4, 6, SEPARATOR]
    assert isinstance(small_store.tokens, np.memmap)  # memory-mapped, not read


def test_find_returns_every_occurrence(small_store):
    lo, hi = small_store.find([2, 3])
    assert hi - lo == 4
    assert sorted(small_store.tokens[small_store.suffixes[i] + 2] for i in range(lo, hi)) == [4, 4, 4, 5]
    lo, hi = small_store.find([3, 1])
    assert lo == hi  # absent: an empty range


def test_longest_match_searches_lengths_by_bisection(small_store):
    length, lo, hi = small_store.longest_match([0, 7, 1, 2, 3], 1, 16)
    assert length == 4 and hi - lo == 1  # "7 1 2 3" occurs once
    length, lo, hi = small_store.longest_match([0, 8, 2, 3], 2, 16)
    assert length == 2 and hi - lo == 4
    assert small_store.longest_match([0, 8, 2, 3], 3, 16) is None


def test_continuations_stop_at_the_end_of_a_text(small_store):
    lo, hi = small_store.find([1, 2, 3])
    assert sorted(small_store.continuations(lo, hi, 3, 3, 100)) == [[4], [4, 6], [5]]
    assert len(small_store.continuations(lo, hi, 3, 3, 2)) == 2  # a spread sample of the range


def test_drafts_keep_the_most_frequent_branches(small_store):
    drafter = RestDrafter(small_store, min_query=2, max_nodes=3)
    draft = drafter.propose(torch.tensor([0, 9, 2, 3]), 10)  # longest match "9 2 3": one continuation, "4 8"
    assert draft.tokens.tolist() == [4, 8]
    draft = drafter.propose(torch.tensor([0, 0, 2, 3]), 10)  # "2 3": 4 (x3, then 6 | end | 8), 5 (x1)
    assert draft.tokens.tolist()[:2] == [4, 5] and draft.parents.tolist()[:2] == [ROOT, ROOT]
    assert len(draft) == 3 and draft.parents.tolist()[2] == 0


def test_context_adds_the_requests_own_repetition_above_the_corpus(small_store, tmp_path):
    """context=True: the continuation of the tail's last occurrence in the context outweighs all corpus matches."""
    context = torch.tensor([2, 3, 7, 7, 0, 2, 3])  # "2 3" was followed by "7 7 0" here, by 4 (x4) and 5 in the corpus
    corpus_only = RestDrafter(small_store, min_query=2, max_nodes=4).propose(context, 10)
    both = RestDrafter(small_store, min_query=2, max_nodes=8, context=True).propose(context, 10)
    assert corpus_only.tokens.tolist()[0] == 4 and 7 not in corpus_only.tokens.tolist()
    assert both.tokens.tolist()[:2] == [7, 4] and both.parents.tolist()[:2] == [ROOT, ROOT]  # 7 first: heavier
    assert len(both) == 8  # the whole 6-token context branch, then the corpus's two heaviest nodes
    write_datastore([], tmp_path / "empty", progress=False)
    alone = RestDrafter(Datastore(tmp_path / "empty"), context=True).propose(context, 10)
    assert alone.tokens.tolist() == [7, 7, 0, 2, 3, 7]  # copied on past the end, draft_depth 6


def test_empty_datastore_matches_nothing(tmp_path):
    write_datastore([], tmp_path, progress=False)
    store = Datastore(tmp_path)
    assert len(store) == 0 and store.longest_match([1, 2, 3], 1, 3) is None
    assert len(RestDrafter(store).propose(torch.tensor([1, 2, 3]), 10)) == 0


def test_build_datastore_tokenizes_texts(tokenizer, tmp_path):
    texts = ["def add(a, b):\n    return a + b\n", "Hello world"]
    meta = build_datastore(tokenizer, iter(texts), tmp_path, batch_size=1, progress=False)
    expected = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    assert meta["texts"] == 2 and meta["tokens"] == sum(map(len, expected)) and meta["vocab_size"] == len(tokenizer)
    assert json.loads((tmp_path / "datastore.json").read_text()) == meta
    assert Datastore(tmp_path).tokens.tolist() == expected[0] + [SEPARATOR] + expected[1] + [SEPARATOR]


def test_clear_errors(small_store, tmp_path):
    with pytest.raises(FileNotFoundError, match="datastore build"):
        Datastore(tmp_path / "missing")
    with pytest.raises(ValueError, match="needs a datastore"):
        open_datastore(None, 100)
    with pytest.raises(ValueError, match="another tokenizer"):
        open_datastore(small_store.path, vocab_size=9)
    with pytest.raises(ValueError, match="sort_depth"):
        RestDrafter(small_store, max_query=65)
    with pytest.raises(ValueError):
        RestDrafter(small_store, min_query=3, max_query=2)
    with pytest.raises(ValueError):
        write_datastore([[1, -5]], tmp_path / "bad", progress=False)


def test_a_truncated_datastore_file_is_named(small_store):
    path = small_store.path / "suffix_array.npy"
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(CorruptFileError, match=r"suffix_array.npy has \d+ bytes where datastore.json records") as error:
        Datastore(small_store.path)
    assert f"accelgen datastore build --model M --dataset sharegpt --out {small_store.path}" in str(error.value)


def test_files_of_another_build_are_refused(small_store, tmp_path):
    """Another build's tokens.npy beside this build's suffix array and datastore.json (what an in-place rebuild
    killed after its first file left) is refused, never searched."""
    write_datastore([[1, 2, 3, 4]] * 30, tmp_path / "other", progress=False)
    shutil.copy(tmp_path / "other" / "tokens.npy", small_store.path / "tokens.npy")
    with pytest.raises(CorruptFileError, match="from another build; rebuild the datastore"):
        Datastore(small_store.path)


def test_lookups_stay_fast_on_a_large_datastore(tmp_path):
    rng = np.random.default_rng(0)
    write_datastore((rng.integers(0, 2000, size=500).tolist() for _ in range(1000)), tmp_path, progress=False)
    drafter = RestDrafter(Datastore(tmp_path))
    contexts = [torch.from_numpy(rng.integers(0, 2000, size=64)) for _ in range(50)]
    started = time.perf_counter()
    for context in contexts:
        drafter.propose(context, 32)
    per_step = (time.perf_counter() - started) / len(contexts)
    assert per_step < 20e-3, f"{per_step * 1e3:.1f} ms per proposal"


# --- lossless generation -----------------------------------------------------------------------------------


def test_empty_datastore_decodes_one_token_per_step(tiny_target, tokenizer, assert_lossless, tmp_path):
    write_datastore([], tmp_path, progress=False)
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "rest", 20, datastore=str(tmp_path))
    assert result.stats["draft_tokens"] == 0 and result.stats["target_forwards"] == 20


def test_partly_right_corpus_is_verified_as_trees(tiny_target, tokenizer, greedy, assert_lossless, tmp_path):
    continuation = greedy(tiny_target, tokenizer, PROMPT, 40).token_ids
    text = PROMPT + continuation
    corpus = [text, text[:20] + [7] + text[21:], text[:30] + [8] + text[31:], text[:12] + [9, 9, 9]]
    write_datastore(corpus, tmp_path, progress=False)
    store = Datastore(tmp_path)
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "rest", 40, datastore=store, max_nodes=12)
    assert result.stats["mean_accepted_tokens"] > 3
    assert result.stats["draft_tokens"] > result.stats["accepted_draft_tokens"]  # branches were rejected


def test_copy_task_on_smollm(smollm, copy_prompt, code, assert_lossless, tmp_path):
    model, tokenizer = smollm
    build_datastore(tokenizer, [code, "def add(a, b):\n    return a + b\n", "This function returns a value."], tmp_path,
                    progress=False)
    result = assert_lossless(model, tokenizer, copy_prompt, "rest", 40, datastore=str(tmp_path))
    assert result.stats["mean_accepted_tokens"] > 1.5


def test_context_copies_the_prompt_without_a_corpus(smollm, copy_prompt, assert_lossless, tmp_path):
    model, tokenizer = smollm
    write_datastore([], tmp_path, progress=False)
    result = assert_lossless(model, tokenizer, copy_prompt, "rest", 40, datastore=str(tmp_path), context=True)
    assert result.stats["mean_accepted_tokens"] > 1.5


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(assert_samples_target, tmp_path):
    write_datastore([[1, 3, 4, 5, 6], [3, 4, 7, 1], [3, 4, 5, 5], [4, 4, 4]], tmp_path, progress=False)
    assert_samples_target("rest", [1, 6, 3, 4], datastore=str(tmp_path), min_query=1)
    assert_samples_target("rest", [1, 6, 3, 4], datastore=str(tmp_path), min_query=1, context=True)
