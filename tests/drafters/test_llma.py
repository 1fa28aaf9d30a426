"""LLMA: reference documents, span copying, and lossless generation."""

import pytest
import torch

import accelgen
from accelgen.draft import ROOT
from accelgen.drafters.llma import ReferenceDrafter, index_references, reference_token_ids, span_after
from accelgen.drafters.base import BuildContext
from accelgen.drafters.llma import ReferenceOptions

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]


def corrupted(tokens, every):
    """tokens with every `every`-th one replaced: a reference the output overlaps only partly."""
    return [token + 1 if i % every == every - 1 else token for i, token in enumerate(tokens)]


# --- data structures ---------------------------------------------------------------------------------------


def test_references_are_token_lists_or_text_with_a_tokenizer(tokenizer):
    assert reference_token_ids([[1, 2], (3,), torch.tensor([4, 5])]) == [[1, 2], [3], [4, 5]]
    assert reference_token_ids(["def f(x):"], tokenizer) == [tokenizer("def f(x):", add_special_tokens=False).input_ids]
    with pytest.raises(ValueError, match="tokenizer"):
        reference_token_ids(["some text"])
    with pytest.raises(TypeError):
        reference_token_ids("one string, not a list")
    with pytest.raises(TypeError):
        reference_token_ids([[1, -2]])


def test_spans_stop_at_the_end_of_their_document():
    index = index_references([[1, 2, 3], [2, 4]], max_match=2)
    assert index.occurrences((2,)) == [2, 5]
    assert span_after(index.tokens, 2, 5) == [3]
    assert span_after(index.tokens, 5, 5) == [4]
    assert index.occurrences((3, 2)) == []  # no match across documents


def test_longest_match_wins_and_branches_add_other_spans():
    references = [[1, 2, 3, 4, 5], [9, 3, 7, 7], [2, 3, 8]]
    drafter = ReferenceDrafter(references, max_match=2, copy_length=2)
    assert drafter.propose(torch.tensor([0, 2, 3]), 8).tokens.tolist() == [4, 5]  # (2, 3) beats (3,)
    drafter = ReferenceDrafter(references, max_match=2, copy_length=2, branches=3)
    draft = drafter.propose(torch.tensor([0, 2, 3]), 8)
    # (2, 3): [4 5], [8]; then (3,): [7 7]
    assert draft.tokens.tolist() == [4, 8, 7, 5, 7]
    assert draft.parents.tolist() == [ROOT, ROOT, ROOT, 0, 2]


def test_no_match_or_no_reference_drafts_nothing():
    assert len(ReferenceDrafter([[1, 2, 3]]).propose(torch.tensor([7, 8]), 8)) == 0
    assert len(ReferenceDrafter([]).propose(torch.tensor([7, 8]), 8)) == 0
    assert len(ReferenceDrafter([[1, 2]], min_match=2).propose(torch.tensor([7, 1]), 8)) == 0


@pytest.mark.parametrize("options", [dict(min_match=0), dict(min_match=5, max_match=4), dict(copy_length=0),
                                     dict(branches=0)])
def test_bad_options_are_refused(options):
    with pytest.raises(ValueError):
        ReferenceDrafter([[1, 2]], **options)


def test_factory_tokenizes_text_when_given_the_tokenizer(tiny_target, tokenizer):
    make = accelgen.get_method("llma").drafter.make
    drafter = make(BuildContext(tiny_target, tokenizer=tokenizer), ReferenceOptions(references=["a + b"]))
    assert drafter.index.tokens[:-1] == tokenizer("a + b", add_special_tokens=False).input_ids


# --- lossless generation -----------------------------------------------------------------------------------


def test_empty_references_decode_one_token_per_step(tiny_target, tokenizer, assert_lossless):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "llma", 20)
    assert result.stats["draft_tokens"] == 0 and result.stats["target_forwards"] == 20


@pytest.mark.parametrize("branches", [1, 2])
def test_partly_right_reference_is_accepted_in_parts(tiny_target, tokenizer, greedy, assert_lossless, branches):
    continuation = greedy(tiny_target, tokenizer, PROMPT, 40).token_ids
    references = [PROMPT[-2:] + corrupted(continuation, 7), corrupted(PROMPT[-1:] + continuation, 3)]
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "llma", 40, references=references, branches=branches)
    assert result.stats["mean_accepted_tokens"] > 3
    assert 0 < result.stats["acceptance_rate"] < 1


def test_retrieval_augmented_copy_on_smollm(smollm, copy_prompt, code, assert_lossless):
    model, tokenizer = smollm
    references = [tokenizer(code, add_special_tokens=False).input_ids, tokenizer("An unrelated document.").input_ids]
    result = assert_lossless(model, tokenizer, copy_prompt, "llma", 40, references=references, branches=2)
    assert result.stats["mean_accepted_tokens"] > 1.5


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(assert_samples_target):
    assert_samples_target("llma", [1, 3, 4], references=[[3, 4, 5, 6, 1, 3, 4, 7], [4, 4, 4]], branches=2)
