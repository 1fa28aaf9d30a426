"""BiTA: greedy-exact against `autoregressive` with prompt and mask tokens untrained, set to be right on a cycle,
trained, and with drafts forced all, partly or never right (an oracle in place of the masks' guesses, while the
groups are still appended to every verifying forward); EOS inside a draft; max_new_tokens below a draft; on a tiny
model and on SmolLM2-135M fp32. Clear errors for missing, other-model and other-method mask tokens."""

import pytest
import torch

import accelgen
from accelgen.train.bita import BitaConfig, new_bita_tokens
from accelgen.train.mask_tokens import train_mask_tokens
from accelgen.train.space import SpaceConfig, new_space_tokens

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]


def saved(tokens, folder) -> str:
    tokens.save(folder)
    return str(folder)


def cycle_masks(model, tokens: list[int], folder, prompts: int = 2) -> str:
    """Masks set to the embeddings of `tokens`: on the cycling model a row's logits depend on its own input alone,
    so mask i guesses what follows tokens[i] (the prompts, whatever they are, change nothing)."""
    masks = new_bita_tokens(model, BitaConfig(count=len(tokens), prompts=prompts))
    with torch.no_grad():
        masks.masks.copy_(model.get_input_embeddings().weight[tokens])
    return saved(masks, folder)


@pytest.mark.parametrize("offsets, longest", [([1, 2, 3], 3), ([1, 2, 5], 2)])
def test_masks_right_on_a_cycle_are_accepted_wholly_or_partly(cycling_model, tokenizer, cycle_prompt, greedy,
                                                             assert_lossless, tmp_path, offsets, longest):
    """Masks for cycle[1], cycle[2], cycle[3] guess cycle[2..4]: a whole draft where the accepted text ends at
    cycle[0], none elsewhere; with [1, 2, 5] at most two in a row."""
    cycle = greedy(cycling_model, tokenizer, cycle_prompt, 6).token_ids
    folder = cycle_masks(cycling_model, [cycle[offset] for offset in offsets], tmp_path)
    result = assert_lossless(cycling_model, tokenizer, cycle_prompt, "bita", 40, heads=folder)
    steps = result.stats["accepted_per_step"]
    assert max(steps) == longest and 0 in steps


def test_untrained_tokens_are_lossless(tiny_target, tokenizer, assert_lossless, tmp_path):
    folder = saved(new_bita_tokens(tiny_target, BitaConfig()), tmp_path)
    assert_lossless(tiny_target, tokenizer, PROMPT, "bita", 30, heads=folder)


def test_trained_tokens_are_lossless(tiny_target, tokenizer, tiny_target_windows, assert_lossless, tmp_path):
    tokens = new_bita_tokens(tiny_target, BitaConfig())
    tokens, _ = train_mask_tokens(tiny_target, tokens, tiny_target_windows, BitaConfig(steps=20, cuts=8))
    assert_lossless(tiny_target, tokenizer, PROMPT, "bita", 40, heads=saved(tokens, tmp_path))


@pytest.mark.parametrize("wrong_from, accepted", [(None, 3), (1, 1), (0, 0)])
def test_drafts_all_partly_or_never_right(tiny_target, tokenizer, greedy, assert_lossless, tmp_path,
                                          wrong_from, accepted, mask_oracle):
    reference = greedy(tiny_target, tokenizer, PROMPT, 40).token_ids + [0] * 8
    folder = saved(new_bita_tokens(tiny_target, BitaConfig()), tmp_path)
    mask_oracle(reference, len(PROMPT), wrong_from)
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "bita", 40, heads=folder)
    assert set(result.stats["accepted_per_step"][1:-1]) == {accepted}  # (the first step has no draft yet)


def test_eos_inside_a_draft_ends_generation_there(tiny_target, tokenizer, greedy, tmp_path, mask_oracle):
    reference = greedy(tiny_target, tokenizer, PROMPT, 40).token_ids
    eos = reference[5]
    expected = reference[: reference.index(eos) + 1]
    mask_oracle(reference + [0] * 8, len(PROMPT), None)
    folder = saved(new_bita_tokens(tiny_target, BitaConfig()), tmp_path)
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, method="bita", heads=folder, max_new_tokens=40,
                               eos_token_id=eos)
    assert result.token_ids == expected and result.finish_reason == "stop"


@pytest.mark.parametrize("budget", [1, 2, 3, 4])
def test_max_new_tokens_smaller_than_a_draft(tiny_target, tokenizer, greedy, assert_lossless, tmp_path,
                                             budget, mask_oracle):
    reference = greedy(tiny_target, tokenizer, PROMPT, 8).token_ids + [0] * 8
    mask_oracle(reference, len(PROMPT), None)
    folder = saved(new_bita_tokens(tiny_target, BitaConfig(count=5)), tmp_path)
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "bita", budget, heads=folder)
    assert len(result.token_ids) == budget


@pytest.mark.slow  # SmolLM2 twice; the tiny-model tests here run bita end to end by default
def test_smollm2_is_lossless_with_untrained_and_oracle_drafts(smollm, copy_prompt, assert_lossless, greedy,
                                                               tmp_path, mask_oracle):
    model, tokenizer = smollm
    folder = saved(new_bita_tokens(model, BitaConfig()), tmp_path)
    assert_lossless(model, tokenizer, copy_prompt, "bita", 24, heads=folder)
    reference = greedy(model, tokenizer, copy_prompt, 24).token_ids + [0] * 8
    from accelgen.prompts import encode_prompt
    mask_oracle(reference, len(encode_prompt(tokenizer, copy_prompt)), 2)
    result = assert_lossless(model, tokenizer, copy_prompt, "bita", 24, heads=folder)
    assert 2 in result.stats["accepted_per_step"]


def test_missing_other_model_and_other_method_tokens_are_refused(tiny_target, tiny_draft, make_tiny_model, tokenizer,
                                                                 tmp_path):
    with pytest.raises(ValueError, match="bita needs trained mask tokens"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="bita", max_new_tokens=4)
    with pytest.raises(FileNotFoundError, match="accelgen train bita"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="bita", heads=str(tmp_path / "none"), max_new_tokens=4)
    other = saved(new_bita_tokens(tiny_draft, BitaConfig()), tmp_path / "other")  # same shapes, other weights
    with pytest.raises(ValueError, match="belong to another model"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="bita", heads=other, max_new_tokens=4)
    wider = saved(new_bita_tokens(make_tiny_model("qwen2", vocab_size=1024), BitaConfig()), tmp_path / "wider")
    with pytest.raises(ValueError, match="vocabulary 1024"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="bita", heads=wider, max_new_tokens=4)
    space = saved(new_space_tokens(tiny_target, SpaceConfig(rank=2)), tmp_path / "space")
    with pytest.raises(ValueError, match="holds space mask tokens, not bita's"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="bita", heads=space, max_new_tokens=4)
    folder = saved(new_bita_tokens(tiny_target, BitaConfig()), tmp_path / "mine")
    with pytest.raises(ValueError, match="greedy decoding only"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="bita", heads=folder, temperature=1.0)


def test_several_prompts_decode_as_if_alone(tiny_target, tokenizer, greedy, tmp_path):
    folder = saved(new_bita_tokens(tiny_target, BitaConfig()), tmp_path)
    prompts = [PROMPT, [7, 8, 9, 10]]
    results = accelgen.generate(tiny_target, tokenizer, prompts, method="bita", heads=folder, max_new_tokens=12)
    assert [r.token_ids for r in results] == [greedy(tiny_target, tokenizer, p, 12).token_ids for p in prompts]


def test_fewer_masks_per_group_draft_shorter_and_stay_lossless(cycling_model, tokenizer, cycle_prompt, greedy,
                                                               assert_lossless, tmp_path):
    """masks=2 of 3 trained: the first two masks' rows are those of the whole group, so the draft is their two
    guesses (on the cycle, right where the whole draft was)."""
    cycle = greedy(cycling_model, tokenizer, cycle_prompt, 6).token_ids
    folder = cycle_masks(cycling_model, [cycle[offset] for offset in (1, 2, 3)], tmp_path)
    result = assert_lossless(cycling_model, tokenizer, cycle_prompt, "bita", 40, heads=folder, masks=2)
    assert max(result.stats["accepted_per_step"]) == 2
    with pytest.raises(ValueError, match="masks=4: these mask tokens have 3 masks"):
        accelgen.generate(cycling_model, tokenizer, cycle_prompt, method="bita", heads=folder, masks=4)
