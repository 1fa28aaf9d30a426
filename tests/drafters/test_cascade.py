"""Cascade speculative drafting: the vertical cascade (the n-gram/bigram model drafts for the draft model) and
the horizontal one (the n-gram/bigram model continues after the draft model); lossless greedy, exact sampling."""

import copy

import pytest
import torch

import accelgen
from accelgen.drafters.cascade import CascadeDrafter
from accelgen.drafters.draft_model import DraftModelDrafter
from accelgen.drafters.stage_two import ContextNGramModel
from accelgen.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]
GREEDY = SamplingConfig()


def test_draft_is_the_draft_models_chain_then_the_statistical_tail(cycling_model, cycle_prompt):
    drafter = CascadeDrafter(cycling_model, GREEDY, None, gamma=3, tail_tokens=4)
    draft = drafter.propose(torch.tensor(cycle_prompt), max_nodes=16)
    head = DraftModelDrafter(cycling_model, GREEDY, None, gamma=3).propose(torch.tensor(cycle_prompt), 3)
    cheap = ContextNGramModel(max_ngram=3)
    cheap.observe(cycle_prompt)
    assert draft.is_chain and draft.tokens[:3].tolist() == head.tokens.tolist()
    assert draft.tokens[3:].tolist() == cheap.propose(cycle_prompt + head.tokens.tolist(), 4)
    assert len(drafter.propose(torch.tensor(cycle_prompt), max_nodes=4)) == 4  # 3 from the model, 1 from the tail
    assert len(drafter.propose(torch.tensor(cycle_prompt), max_nodes=2)) == 2  # the model's positions come first


def test_sampled_tail_carries_point_masses(cycling_model, cycle_prompt):
    drafter = CascadeDrafter(cycling_model, SamplingConfig(1.0), torch.Generator().manual_seed(0), gamma=2,
                             tail_tokens=3)
    draft = drafter.propose(torch.tensor(cycle_prompt), max_nodes=16)
    assert len(draft) == 5 and draft.draft_probs.shape == (5, cycling_model.config.vocab_size)
    assert (draft.draft_probs[:2] < 1).all()  # the draft model's distributions
    assert draft.draft_probs[2:].eq(1).sum(-1).tolist() == [1, 1, 1]
    assert draft.draft_probs[torch.arange(2, 5), draft.tokens[2:]].tolist() == [1.0, 1.0, 1.0]


def test_vertical_cascade_saves_draft_forwards_without_changing_the_draft(cycling_model, cycle_prompt):
    drafts = {}
    for stage_two_tokens in (0, 4):
        drafter = CascadeDrafter(cycling_model, GREEDY, None, gamma=6, tail_tokens=0, stage_two_tokens=stage_two_tokens)
        drafts[stage_two_tokens] = drafter.propose(torch.tensor(cycle_prompt), max_nodes=16).tokens.tolist()
        forwards = drafter.stage_two.forwards
        assert forwards == (6 if stage_two_tokens == 0 else 2)  # alone: one forward per token
    assert drafts[0] == drafts[4]


def test_self_draft_accepts_every_draft_model_token(tiny_target, tokenizer, assert_lossless):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "cascade", 40, draft_model=tiny_target, gamma=3)
    assert min(result.stats["accepted_per_step"][:5]) >= 3


@pytest.mark.parametrize("tail_tokens", [0, 3])
def test_random_draft_is_lossless(tiny_target, tiny_draft, tokenizer, assert_lossless, tail_tokens):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "cascade", 30, draft_model=tiny_draft,
                             tail_tokens=tail_tokens)
    assert result.stats["accepted_draft_tokens"] == 0  # the tail only ever follows a rejected first token


def test_horizontal_tail_is_accepted_on_repetitive_text(cycling_model, cycle_prompt, tokenizer, assert_lossless):
    result = assert_lossless(cycling_model, tokenizer, cycle_prompt, "cascade", 14, draft_model=cycling_model,
                             gamma=2, tail_tokens=4)
    assert result.stats["accepted_per_step"][:2] == [6, 6]  # 2 draft-model tokens + 4 statistical ones


def test_smollm_draft_is_lossless_with_partial_acceptance(smollm, smollm_26_layers, copy_prompt, assert_lossless):
    model, tokenizer = smollm
    result = assert_lossless(model, tokenizer, copy_prompt, "cascade", 16,
                             draft_budget="method", draft_model=smollm_26_layers)
    assert 0 < result.stats["acceptance_rate"] < 1 and result.stats["mean_accepted_tokens"] > 1.3


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3])
def test_max_new_tokens_smaller_than_a_draft(tiny_target, tokenizer, assert_lossless, max_new_tokens):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "cascade", max_new_tokens, draft_model=tiny_target,
                             gamma=4, tail_tokens=4)
    assert len(result.token_ids) == max_new_tokens


def test_eos_inside_the_tail_ends_generation_there(cycling_model, cycle_prompt, tokenizer, greedy):
    plain = greedy(cycling_model, tokenizer, cycle_prompt, 12).token_ids
    position = next(i for i in range(2, 12) if plain[i] not in plain[:i])  # its first occurrence, in the tail
    model = copy.deepcopy(cycling_model)
    model.generation_config.eos_token_id = plain[position]
    result = accelgen.generate(model, tokenizer, cycle_prompt, method="cascade", draft_model=model,
                               max_new_tokens=12, gamma=1, tail_tokens=6)
    assert result.token_ids == plain[: position + 1] and result.finish_reason == "stop"
    assert result.stats["target_forwards"] == 1


def test_the_tail_drafts_alone_once_the_draft_models_context_is_full(cycling_model, cycle_prompt, tokenizer,
                                                                      assert_lossless):
    short = copy.deepcopy(cycling_model)
    short.config.max_position_embeddings = len(cycle_prompt) + 2  # room for 2 draft-model tokens only
    result = assert_lossless(cycling_model, tokenizer, cycle_prompt, "cascade", 16, draft_model=short, gamma=3,
                             tail_tokens=4)
    assert result.stats["mean_accepted_tokens"] > 3


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(assert_samples_target, sampling_draft):
    # the prompt gives every token but EOS a bigram follower, so a tail is drafted at every step; tail rows other
    # than point masses (e.g. uniform) fail this test
    assert_samples_target("cascade", [1, 3, 4, 5, 6, 7, 0, 1, 3], draft_model=sampling_draft, gamma=1, tail_tokens=2)


def test_clear_errors(tiny_target, tokenizer):
    for option, message in [({"gamma": 0}, "gamma"), ({"tail_tokens": -1}, "tail_tokens"),
                            ({"stage_two_tokens": -1}, "stage_two_tokens"), ({"max_ngram": 0}, "max_ngram"),
                            ({"branches": 2}, "no option")]:
        with pytest.raises(ValueError, match=message):
            accelgen.generate(tiny_target, tokenizer, PROMPT, method="cascade", draft_model=tiny_target, **option)
