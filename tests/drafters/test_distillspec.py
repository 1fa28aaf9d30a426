"""`distillspec`: speculative decoding with a draft distilled for this target; exact, and refused for a draft
that was not distilled for it."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import accelgen
from accelgen.train.distill import distill, distilled_for, save_distilled

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 92, 44, 77, 12], [5, 17, 92, 44, 77, 13], [300, 8, 41, 7]]


def noisy_copy(model, noise: float, seed: int):
    """The model with noise on its decoder weights: a draft that agrees with it at some positions only."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.model.layers.parameters():
            if parameter.dim() == 2:
                parameter.add_(noise * parameter.std() * torch.randn(parameter.shape, generator=generator))
    return draft


def distilled_folder(target, draft, tokenizer, folder, prompts=PROMPTS[:2]):
    """A few DistillSpec steps on prompts, saved as `accelgen train distillspec` saves them; the draft reloaded."""
    distill(target, draft, tokenizer, prompts, steps=3, batch_size=2, max_new_tokens=12, divergence_name="fkl",
            learning_rate=5e-4)
    save_distilled(draft, tokenizer, folder, {**distilled_for(target, "tiny-target"), "draft": "noisy copy"})
    return AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def distilled(sharp_target, tokenizer, tmp_path_factory):
    return distilled_folder(sharp_target, noisy_copy(sharp_target, 0.1, seed=5), tokenizer,
                            tmp_path_factory.mktemp("distilled"))


def test_greedy_decoding_is_exact_with_drafts_partly_accepted(sharp_target, distilled, tokenizer, assert_lossless):
    accepted = drafted = 0
    for prompt in PROMPTS:
        stats = assert_lossless(sharp_target, tokenizer, prompt, "distillspec", 24, draft_model=distilled,
                                gamma=4).stats
        accepted, drafted = accepted + stats["accepted_draft_tokens"], drafted + stats["draft_tokens"]
    assert 0 < accepted < drafted


def test_max_new_tokens_below_gamma(sharp_target, distilled, tokenizer, assert_lossless):
    for max_new_tokens in (0, 1, 2):
        result = assert_lossless(sharp_target, tokenizer, PROMPTS[0], "distillspec", max_new_tokens,
                                 draft_model=distilled, gamma=5)
        assert len(result.token_ids) == max_new_tokens


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(sampling_model, sampling_draft, tokenizer, assert_samples_target,
                                                 tmp_path):
    draft = distilled_folder(sampling_model, copy.deepcopy(sampling_draft), tokenizer, tmp_path,
                             prompts=[[1, 3, 4], [5, 6]])
    assert_samples_target("distillspec", [1, 3, 4], draft_model=draft, gamma=2)


def test_a_draft_not_distilled_for_this_target_is_refused(sharp_target, distilled, make_tiny_model, tokenizer):
    undistilled = noisy_copy(sharp_target, 0.1, seed=5)
    with pytest.raises(ValueError, match="this draft has none. Distill one with `accelgen train distillspec --model TARGET"):
        accelgen.generate(sharp_target, tokenizer, PROMPTS[0], method="distillspec", draft_model=undistilled,
                          max_new_tokens=4)
    other_target = make_tiny_model("qwen2", seed=9, vocab_size=1024)
    with pytest.raises(ValueError, match="distilled for 'tiny-target', not for this target"):
        accelgen.generate(other_target, tokenizer, PROMPTS[0], method="distillspec", draft_model=distilled,
                          max_new_tokens=4)
    other_vocabulary = make_tiny_model("llama", seed=1, vocab_size=2048)
    with pytest.raises(ValueError, match="vocabulary"):
        accelgen.generate(sharp_target, tokenizer, PROMPTS[0], method="distillspec", draft_model=other_vocabulary,
                          max_new_tokens=4)
