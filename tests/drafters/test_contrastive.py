"""contrastive: the amateur's drafts carry its distributions; alpha = 0 is greedy decoding; alpha > 0 commits
exactly the tokens of contrastive greedy decoding computed the slow way."""

import pytest
import torch

import accelgen
from accelgen.drafters.draft_model import DraftModelDrafter
from accelgen.prompts import encode_prompt
from accelgen.sampling import SamplingConfig
from accelgen.verify.contrastive import contrastive_scores

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


def test_drafts_carry_the_amateur_distributions(tiny_draft, assert_reordered):
    drafter = DraftModelDrafter(tiny_draft, SamplingConfig(), None, gamma=4, greedy_draft_probs=True)
    context = PROMPT
    for _ in range(2):  # the second proposal reuses the draft cache after a partial acceptance
        draft = drafter.propose(torch.tensor(context), max_nodes=8)
        assert len(draft) == 4 and torch.equal(draft.draft_probs.argmax(dim=-1), draft.tokens)
        for i in range(len(draft)):
            with torch.no_grad():
                logits = tiny_draft(torch.tensor([context + draft.tokens[:i].tolist()])).logits[0, -1]
            assert_reordered(draft.draft_probs[i], torch.softmax(logits, dim=-1))
        context = context + draft.tokens[:2].tolist() + [31337]


def test_alpha_zero_is_lossless(smollm, smollm_shallow, tiny_target, tokenizer, assert_lossless):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "contrastive", 30, draft_model=tiny_target, gamma=4,
                             alpha=0.0)
    assert result.stats["accepted_per_step"][:5] == [4] * 5
    model, smollm_tokenizer = smollm
    result = assert_lossless(model, smollm_tokenizer, CHAT, "contrastive", 20, draft_model=smollm_shallow, gamma=4,
                             alpha=0.0)
    assert 0 < result.stats["acceptance_rate"] < 1


def contrastive_reference(expert, amateur, prompt_ids, max_new_tokens, alpha, beta) -> list[int]:
    """Contrastive greedy decoding the slow, obvious way: both models re-read the whole sequence for every
    token. The last token is the expert's own, as in the method (the loop drafts nothing for it)."""
    ids = list(prompt_ids)
    for step in range(max_new_tokens):
        with torch.no_grad():
            expert_logits = expert(torch.tensor([ids])).logits[0, -1:].float()  # (1, vocab)
            amateur_probs = torch.softmax(amateur(torch.tensor([ids])).logits[0, -1:].float(), dim=-1)
        if step == max_new_tokens - 1:
            ids.append(int(expert_logits.argmax()))
        else:
            ids.append(int(contrastive_scores(expert_logits, amateur_probs, alpha, beta).argmax()))
    return ids[len(prompt_ids):]


@pytest.fixture(scope="module")
def contrastive_expected(smollm, smollm_shallow):
    model, tokenizer = smollm
    return contrastive_reference(model, smollm_shallow, encode_prompt(tokenizer, CHAT), 16, alpha=0.5, beta=0.1)


@pytest.mark.parametrize("gamma", [1, 4])
def test_output_is_contrastive_greedy_decoding(smollm, smollm_shallow, greedy, contrastive_expected, gamma):
    model, tokenizer = smollm
    result = accelgen.generate(model, tokenizer, CHAT, method="contrastive", draft_model=smollm_shallow,
                               max_new_tokens=16, gamma=gamma, alpha=0.5, beta=0.1)
    assert result.token_ids == contrastive_expected
    assert contrastive_expected != greedy(model, tokenizer, CHAT, 16).token_ids  # the contrast changes the output
    if gamma > 1:
        assert result.stats["target_forwards"] < 16  # several tokens per target forward


def test_sampling_is_refused_by_name(tiny_target, tokenizer):
    with pytest.raises(ValueError, match="'contrastive' supports greedy decoding only"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="contrastive", draft_model=tiny_target, temperature=1.0)


@pytest.mark.parametrize("options", [{"alpha": -1.0}, {"beta": 2.0}, {"gamma": 0}])
def test_bad_options_are_clear_errors(tiny_target, tokenizer, options):
    with pytest.raises(ValueError, match="alpha|beta|gamma"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="contrastive", draft_model=tiny_target, **options)
