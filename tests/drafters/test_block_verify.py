"""block-verify: draft-model speculative decoding with block verification, lossless and exact."""

import pytest

import accelgen

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


def test_self_draft_is_lossless(tiny_target, tokenizer, assert_lossless):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "block-verify", 40, draft_model=tiny_target, gamma=4)
    assert result.stats["accepted_per_step"][:7] == [4] * 7


def test_smollm_shallow_draft_is_lossless_with_partial_acceptance(smollm, smollm_shallow, assert_lossless):
    model, tokenizer = smollm
    result = assert_lossless(model, tokenizer, CHAT, "block-verify", 24, draft_model=smollm_shallow, gamma=4)
    assert 0 < result.stats["acceptance_rate"] < 1 and result.stats["mean_accepted_tokens"] > 1.0


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(assert_samples_target, sampling_draft):
    assert_samples_target("block-verify", [1, 3, 4], draft_model=sampling_draft, gamma=2)


def test_sampling_with_self_draft_accepts_every_block(tiny_target, tokenizer):
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, method="block-verify", draft_model=tiny_target,
                               max_new_tokens=20, temperature=1.0, seed=0, gamma=4)
    assert result.stats["acceptance_rate"] == 1.0
