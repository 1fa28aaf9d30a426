"""SPACE: greedy-exact against `autoregressive` with mask tokens and a mask-position LoRA untrained (the LoRA made
large, so that were it applied to the target's own rows the output would change), trained, and with drafts forced
all, partly or never right; EOS inside a draft; max_new_tokens below a draft; on a tiny model and SmolLM2-135M
fp32. The LoRA acts at the appended positions only, and leaves the model untouched. Clear errors for unfit tokens."""

import pytest
import torch

import accelgen
from accelgen.drafters.mask_drafting import MaskRunner
from accelgen.prompts import encode_prompt
from accelgen.train.bita import BitaConfig, new_bita_tokens
from accelgen.train.mask_tokens import train_mask_tokens
from accelgen.train.space import SpaceConfig, new_space_tokens

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]


def loud_tokens(model, config: SpaceConfig | None = None):
    """Untrained SPACE tokens whose LoRA deltas are far from zero (a fresh LoRA adds nothing: B starts at 0)."""
    tokens = new_space_tokens(model, config or SpaceConfig(rank=4))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in tokens.lora.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return tokens


def saved(tokens, folder) -> str:
    tokens.save(folder)
    return str(folder)


def test_lora_changes_the_mask_rows_only(tiny_target):
    """Over a block with appended positions, the LoRA moves the appended rows and not one of the target's own."""
    tokens = loud_tokens(tiny_target)
    token_ids = torch.tensor(PROMPT)
    appended = tokens.group.detach().repeat(2, 1)
    with torch.no_grad():
        plain = tiny_target(torch.cat([token_ids])[None]).logits[0]
        runner = MaskRunner(tiny_target, tokens)
        adapted = runner.forward(token_ids, appended=appended)
        bare = MaskRunner(tiny_target, new_space_tokens(tiny_target, SpaceConfig(rank=4))).forward(token_ids,
                                                                                                  appended=appended)
    assert torch.allclose(adapted[: len(PROMPT)], plain, atol=1e-5)
    assert (adapted[len(PROMPT) :] - bare[len(PROMPT) :]).abs().max() > 1e-2
    assert not any(module._forward_hooks for module in tiny_target.modules())  # hooks removed after the forward


def test_untrained_tokens_with_a_loud_lora_are_lossless(tiny_target, tokenizer, assert_lossless, tmp_path):
    assert_lossless(tiny_target, tokenizer, PROMPT, "space", 30, heads=saved(loud_tokens(tiny_target), tmp_path))


def test_trained_tokens_are_lossless(tiny_target, tokenizer, tiny_target_windows, assert_lossless, tmp_path):
    tokens = new_space_tokens(tiny_target, SpaceConfig(rank=4))
    tokens, _ = train_mask_tokens(tiny_target, tokens, tiny_target_windows, SpaceConfig(rank=4, steps=20, cuts=8))
    assert any(float(p.detach().abs().max()) > 0 for p in tokens.lora.parameters())
    assert_lossless(tiny_target, tokenizer, PROMPT, "space", 40, heads=saved(tokens, tmp_path))


@pytest.mark.parametrize("wrong_from, accepted", [(None, 3), (2, 2), (0, 0)])
def test_drafts_all_partly_or_never_right(tiny_target, tokenizer, greedy, assert_lossless, tmp_path,
                                          wrong_from, accepted, mask_oracle):
    reference = greedy(tiny_target, tokenizer, PROMPT, 40).token_ids + [0] * 8
    folder = saved(loud_tokens(tiny_target), tmp_path)
    mask_oracle(reference, len(PROMPT), wrong_from)
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "space", 40, heads=folder)
    assert set(result.stats["accepted_per_step"][1:-1]) == {accepted}


def test_eos_inside_a_draft_ends_generation_there(tiny_target, tokenizer, greedy, tmp_path, mask_oracle):
    reference = greedy(tiny_target, tokenizer, PROMPT, 40).token_ids
    eos = reference[6]
    mask_oracle(reference + [0] * 8, len(PROMPT), None)
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, method="space", max_new_tokens=40, eos_token_id=eos,
                               heads=saved(loud_tokens(tiny_target), tmp_path))
    assert result.token_ids == reference[: reference.index(eos) + 1] and result.finish_reason == "stop"


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_max_new_tokens_smaller_than_a_draft(tiny_target, tokenizer, greedy, assert_lossless, tmp_path,
                                             budget, mask_oracle):
    reference = greedy(tiny_target, tokenizer, PROMPT, 8).token_ids + [0] * 8
    mask_oracle(reference, len(PROMPT), None)
    folder = saved(loud_tokens(tiny_target, SpaceConfig(rank=4, count=4)), tmp_path)
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "space", budget, heads=folder)
    assert len(result.token_ids) == budget


def test_smollm2_is_lossless_with_a_loud_lora_and_oracle_drafts(smollm, copy_prompt, assert_lossless, greedy,
                                                                 tmp_path, mask_oracle):
    model, tokenizer = smollm
    folder = saved(loud_tokens(model, SpaceConfig(rank=2, lora_modules="q_proj,v_proj")), tmp_path)
    assert_lossless(model, tokenizer, copy_prompt, "space", 24, heads=folder)
    reference = greedy(model, tokenizer, copy_prompt, 24).token_ids + [0] * 8
    mask_oracle(reference, len(encode_prompt(tokenizer, copy_prompt)), 1)
    result = assert_lossless(model, tokenizer, copy_prompt, "space", 24, heads=folder)
    assert 1 in result.stats["accepted_per_step"]


def test_unfit_tokens_are_refused(tiny_target, tiny_draft, make_tiny_model, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="space needs trained mask tokens"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="space", max_new_tokens=4)
    other = saved(new_space_tokens(tiny_draft, SpaceConfig(rank=2)), tmp_path / "other")
    with pytest.raises(ValueError, match="belong to another model"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="space", heads=other, max_new_tokens=4)
    bita = saved(new_bita_tokens(tiny_target, BitaConfig()), tmp_path / "bita")
    with pytest.raises(ValueError, match="holds bita mask tokens, not space's"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="space", heads=bita, max_new_tokens=4)
    deeper = saved(new_space_tokens(make_tiny_model("qwen2", layers=3), SpaceConfig(rank=2)), tmp_path / "deeper")
    with pytest.raises(ValueError, match="layer count 3"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="space", heads=deeper, max_new_tokens=4)
