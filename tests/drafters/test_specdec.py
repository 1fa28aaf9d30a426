"""specdec: relaxed verification of draft-model drafts; greedy at beta = 1, more accepted when looser."""

import pytest
import torch

import accelgen
from accelgen.drafters.draft_model import DraftModelDrafter
from accelgen.prompts import encode_prompt
from accelgen.quality import matching_prefix, token_agreement
from accelgen.sampling import SamplingConfig
from accelgen.verify import verify_specdec

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


def test_beta_one_is_lossless(tiny_target, tiny_draft, tokenizer, assert_lossless):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "specdec", 30, draft_model=tiny_target, gamma=4, beta=1,
                             tau=0.0)
    assert result.stats["accepted_per_step"][:5] == [4] * 5
    assert_lossless(tiny_target, tokenizer, PROMPT, "specdec", 12, draft_model=tiny_draft, gamma=4, beta=1, tau=5.0)


def test_looser_settings_accept_more_of_the_same_real_drafts(smollm, smollm_shallow, greedy):
    """SmolLM2 drafted by its own first 20 layers (a poor draft: its tokens are often far down the target's
    ranking), at several points of the greedy output: every draft is verified under each setting, and a
    looser setting never accepts fewer of its tokens (and here accepts more in all)."""
    model, tokenizer = smollm
    context = encode_prompt(tokenizer, CHAT) + greedy(model, tokenizer, CHAT, 24).token_ids
    settings = [(1, 0.0), (3, 1.0), (10, 10.0)]
    totals = dict.fromkeys(settings, 0)
    drafter = DraftModelDrafter(smollm_shallow, SamplingConfig(), None, gamma=4)
    for end in range(len(context) - 24, len(context), 3):
        draft = drafter.propose(torch.tensor(context[:end]), max_nodes=4)
        with torch.no_grad():
            target_logits = model(torch.tensor([context[:end] + draft.tokens.tolist()])).logits[0, -len(draft) - 1:]
        accepted = [len(verify_specdec(draft, target_logits, beta, tau).accepted) for beta, tau in settings]
        assert accepted == sorted(accepted)
        for setting, count in zip(settings, accepted):
            totals[setting] += count
    assert totals[1, 0.0] < totals[10, 10.0]


def test_a_loose_setting_departs_from_greedy_output(smollm, smollm_shallow, greedy):
    """beta = 1 reproduces greedy decoding; beta = 10, tau = 10 does not, as token_agreement measures."""
    model, tokenizer = smollm
    expected = greedy(model, tokenizer, CHAT, 20).token_ids
    runs = {(beta, tau): accelgen.generate(model, tokenizer, CHAT, method="specdec", draft_model=smollm_shallow,
                                           max_new_tokens=20, gamma=4, beta=beta, tau=tau)
            for beta, tau in [(1, 0.0), (10, 10.0)]}
    strict, loose = runs[1, 0.0], runs[10, 10.0]
    assert strict.token_ids == expected and token_agreement(expected, strict.token_ids) == 1.0
    shared = matching_prefix(expected, loose.token_ids)
    assert shared < len(expected) and token_agreement(expected, loose.token_ids) < 1.0
    assert loose.token_ids[:shared] == expected[:shared]


def test_sampling_is_refused_by_name(tiny_target, tokenizer):
    with pytest.raises(ValueError, match="'specdec' supports greedy decoding only"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="specdec", draft_model=tiny_target, temperature=0.8)


@pytest.mark.parametrize("options", [{"beta": 0}, {"tau": -1.0}, {"beta": "top3"}])
def test_bad_options_are_clear_errors(tiny_target, tokenizer, options):
    with pytest.raises(ValueError, match="specdec: (beta|tau)"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="specdec", draft_model=tiny_target, **options)
