"""spectr: K i.i.d. draft sequences from the draft model, greedy-lossless and exact when sampling."""

import pytest

import accelgen

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


def test_self_draft_is_lossless(tiny_target, tokenizer, assert_lossless):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "spectr", 30, draft_model=tiny_target, num_drafts=3, gamma=4)
    assert result.stats["accepted_per_step"][:4] == [4] * 4  # later, the room left cuts the 12-node tree


def test_random_draft_is_lossless(tiny_target, tiny_draft, tokenizer, assert_lossless):
    assert_lossless(tiny_target, tokenizer, PROMPT, "spectr", 12, draft_model=tiny_draft, num_drafts=3, gamma=3)


def test_smollm_shallow_draft_is_lossless_with_partial_acceptance(smollm, smollm_shallow, assert_lossless):
    model, tokenizer = smollm
    result = assert_lossless(model, tokenizer, CHAT, "spectr", 20, draft_model=smollm_shallow, num_drafts=2, gamma=4)
    assert 0 < result.stats["acceptance_rate"] < 1 and result.stats["mean_accepted_tokens"] > 1.0


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(assert_samples_target, sampling_draft):
    assert_samples_target("spectr", [1, 3, 4], draft_model=sampling_draft, num_drafts=3, gamma=2)


@pytest.mark.parametrize("options", [{"num_drafts": 0}, {"gamma": 0}, {"num_drafts": "3"}, {"gamma": 2.5}])
def test_bad_options_are_clear_errors(tiny_target, tokenizer, options):
    with pytest.raises(ValueError, match="spectr: (num_drafts|gamma) must be (text or )?an integer"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="spectr", draft_model=tiny_target, **options)
