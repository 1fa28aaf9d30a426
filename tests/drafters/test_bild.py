"""bild: the small model drafts while confident; rollback threshold 0 is greedy decoding whatever the fallback;
EOS inside a draft, max_new_tokens shorter than a draft, and errors."""

import pytest
import torch

import accelgen
from accelgen.drafters.bild import FallbackDrafter
from accelgen.prompts import encode_prompt
from accelgen.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
EOS_PROMPT = [1, 4, 3]  # sampling_model's greedy continuation ends with EOS after a few tokens (checked below)
EOS = 2


def test_drafts_stop_before_the_first_unsure_token(smollm, smollm_shallow):
    model, tokenizer = smollm
    context = torch.tensor(encode_prompt(tokenizer, CHAT))
    drafter = FallbackDrafter(smollm_shallow, SamplingConfig(), None, fallback_threshold=0.6, max_draft=8)
    draft = drafter.propose(context, max_nodes=8)
    confidences = draft.draft_probs.max(dim=-1).values if len(draft) else torch.empty(0)
    assert bool((confidences >= 0.6).all())  # every drafted token was a confident one
    assert 0 < len(draft) < 8  # ...and the draft model was unsure of the next one: the large model picks that token
    with torch.no_grad():
        logits = smollm_shallow(torch.cat([context, draft.tokens])[None]).logits[0, -1]
    assert float(torch.softmax(logits, dim=-1).max()) < 0.6


@pytest.mark.slow  # three SmolLM2 runs; the tests below run bild end to end by default
def test_rollback_zero_is_lossless_fallback_drafts_less_and_tolerance_accepts_more(smollm, smollm_shallow,
                                                                                      assert_lossless):
    model, tokenizer = smollm
    runs = {}
    for fallback in (0.0, 0.9):  # rollback threshold 0: greedy output whatever the fallback
        runs[fallback, 0.0] = assert_lossless(model, tokenizer, CHAT, "bild", 16, draft_model=smollm_shallow,
                                              fallback_threshold=fallback, rollback_threshold=0.0, max_draft=6)
    runs[0.0, 10.0] = accelgen.generate(model, tokenizer, CHAT, method="bild", draft_model=smollm_shallow,
                                        max_new_tokens=16, fallback_threshold=0.0, rollback_threshold=10.0, max_draft=6)
    assert runs[0.0, 0.0].stats["accepted_draft_tokens"] > 0
    assert runs[0.9, 0.0].stats["draft_tokens"] < runs[0.0, 0.0].stats["draft_tokens"]
    assert runs[0.0, 10.0].stats["acceptance_rate"] > runs[0.0, 0.0].stats["acceptance_rate"]


def test_self_draft_accepts_whole_drafts_and_stops_at_eos_inside_one(sampling_model, tokenizer, greedy):
    expected = greedy(sampling_model, tokenizer, EOS_PROMPT, 12)
    assert expected.finish_reason == "stop" and expected.token_ids[-1] == EOS and len(expected.token_ids) >= 4
    for rollback_threshold in (0.0, 3.0):
        result = accelgen.generate(sampling_model, tokenizer, EOS_PROMPT, method="bild", draft_model=sampling_model,
                                   max_new_tokens=12, fallback_threshold=0.0, rollback_threshold=rollback_threshold,
                                   max_draft=8)
        assert result.token_ids == expected.token_ids and result.finish_reason == "stop"
        assert result.stats["target_forwards"] == 1  # EOS came inside the first, fully accepted draft


def test_max_new_tokens_shorter_than_a_draft(tiny_target, tokenizer, greedy):
    expected = greedy(tiny_target, tokenizer, PROMPT, 3).token_ids
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, method="bild", draft_model=tiny_target,
                               max_new_tokens=3, fallback_threshold=0.0, rollback_threshold=0.0, max_draft=8)
    assert result.token_ids == expected and result.finish_reason == "length"
    assert result.stats["draft_tokens"] == 2  # the draft was cut to leave room for the target's own token


def test_sampling_is_refused_by_name(tiny_target, tokenizer):
    with pytest.raises(ValueError, match="'bild' supports greedy decoding only"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="bild", draft_model=tiny_target, temperature=0.7)


@pytest.mark.parametrize("options", [{"fallback_threshold": 1.5}, {"fallback_threshold": -0.1},
                                     {"rollback_threshold": -1.0}, {"max_draft": 0}, {"max_draft": "8"}])
def test_bad_options_are_clear_errors(tiny_target, tokenizer, options):
    with pytest.raises(ValueError, match="bild: (fallback_threshold|rollback_threshold|max_draft)"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="bild", draft_model=tiny_target, **options)
