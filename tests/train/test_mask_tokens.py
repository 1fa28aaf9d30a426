"""The mask-token trainer shared by BiTA and SPACE (train/mask_tokens.py): the training layout computes what
drafting computes (BiTA's prompts, SPACE's LoRA on), training lowers the masks' loss and touches nothing else, a
killed run resumes exactly, and the held-out evaluation counts masks right in a row."""

import copy

import pytest
import torch

from accelgen.draft import Draft
from accelgen.drafters.mask_drafting import MaskDrafter, MaskRunner
from accelgen.heads.mask_tokens import MaskTokens
from accelgen.train.bita import BitaConfig, new_bita_tokens
from accelgen.train.loop import ScaleOut
from accelgen.train.mask_tokens import (
    evaluate_mask_tokens,
    mask_logits,
    train_mask_tokens,
)
from accelgen.train.space import SpaceConfig, new_space_tokens


def assert_layout_matches_drafting(model, tokens: MaskTokens, assert_reordered) -> None:
    """Groups appended at several cuts of a window in one training forward give the mask rows the runner gives
    when it feeds the window up to a cut with the group after it, as a verifying step does; the labels are the
    target's greedy choices k positions on."""
    window = torch.randint(3, 1000, (1, 20), generator=torch.Generator().manual_seed(0))
    cuts = torch.tensor([[4, 9, 15]])
    count = tokens.count
    with torch.no_grad():
        logits, labels = mask_logits(model, tokens, window, cuts)
    drafter = MaskDrafter(tokens)
    for index, cut in enumerate(cuts[0].tolist()):
        runner = MaskRunner(model, tokens)
        appended, tree = drafter.mask_inputs(Draft.empty(), prefix=cut + 1)
        rows = runner.forward(window[0, : cut + 1], tree, len(appended), appended)  # (p + k, vocab)
        assert_reordered(logits[0, count * index : count * (index + 1)], rows[len(rows) - count :])
        full = model(window[:, : cut + count + 1]).logits[0].argmax(-1)
        assert labels[0, count * index : count * (index + 1)].tolist() == full[cut + 1 : cut + count + 1].tolist()


def test_training_layout_computes_what_drafting_computes(tiny_target, assert_reordered):
    assert_layout_matches_drafting(tiny_target, new_bita_tokens(tiny_target, BitaConfig(count=3, prompts=2)),
                                   assert_reordered)


def test_training_layout_computes_what_drafting_computes_with_the_lora(tiny_target, assert_reordered):
    tokens = new_space_tokens(tiny_target, SpaceConfig(rank=4))
    with torch.no_grad():
        for parameter in tokens.lora.parameters():
            parameter.normal_(0, 0.3)
    assert_layout_matches_drafting(tiny_target, tokens, assert_reordered)


def test_training_lowers_the_masks_loss_and_leaves_the_model_alone(tiny_target, tiny_target_windows):
    rows = []
    before = [parameter.clone() for parameter in tiny_target.parameters()]
    config = BitaConfig(count=2, prompts=0, steps=80, cuts=6, learning_rate=0.1)
    train_mask_tokens(tiny_target, new_bita_tokens(tiny_target, config), tiny_target_windows[:2], config,
                      progress=rows.append)
    first, last = (sum(row["loss"] for row in part) / len(part) for part in (rows[:5], rows[-5:]))
    assert last < first - 1.0, (first, last)
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_target.parameters()))
    assert all(parameter.requires_grad for parameter in tiny_target.parameters())


def test_a_killed_run_resumes_exactly(tiny_target, tiny_target_windows, tmp_path):
    config = BitaConfig(count=2, prompts=1, steps=6, cuts=4, checkpoint_every=3)
    whole, _ = train_mask_tokens(tiny_target, new_bita_tokens(tiny_target, config), tiny_target_windows, config)
    halfway = BitaConfig(count=2, prompts=1, steps=3, cuts=4, checkpoint_every=3)
    train_mask_tokens(tiny_target, new_bita_tokens(tiny_target, config), tiny_target_windows, halfway, out_dir=tmp_path)
    resumed, times = train_mask_tokens(tiny_target, new_bita_tokens(tiny_target, config), tiny_target_windows, config,
                                       out_dir=tmp_path)
    assert times["resumed_at"] == 3
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b)
    other = BitaConfig(count=2, prompts=1, steps=6, cuts=5, checkpoint_every=3)
    with pytest.raises(ValueError, match="trained with other settings"):
        train_mask_tokens(tiny_target, new_bita_tokens(tiny_target, other), tiny_target_windows, other,
                          out_dir=tmp_path)


@pytest.mark.parametrize("config, new_tokens", [(BitaConfig(count=2, prompts=1, steps=2, batch_size=4, cuts=4,
                                                            learning_rate=0.1), new_bita_tokens),
                                                 (SpaceConfig(count=2, rank=4, steps=2, batch_size=4, cuts=4,
                                                              learning_rate=0.1, lora_learning_rate=0.1),
                                                  new_space_tokens)])
def test_gradient_accumulation_trains_the_same_tokens(tiny_target, tiny_target_windows, config, new_tokens):
    start = new_tokens(tiny_target, config)  # one start for both: SPACE's LoRA draws its A from torch's global seed
    whole, halves = (train_mask_tokens(tiny_target, copy.deepcopy(start), tiny_target_windows, config,
                                       scale=scale)[0].state_dict() for scale in (None, ScaleOut(grad_accum=2)))
    for name, tensor in whole.items():
        # the batch's gradient summed in two halves rounds otherwise; Adam can scale that up to ~1e-4 × the step (0.1)
        torch.testing.assert_close(halves[name], tensor, rtol=0, atol=1e-5)


def test_evaluation_counts_masks_right_in_a_row(tiny_target, tiny_target_windows):
    tokens = new_bita_tokens(tiny_target, BitaConfig(count=3))
    evaluation = evaluate_mask_tokens(tiny_target, tokens, tiny_target_windows[:2], cuts=5)
    assert evaluation["positions"] == 10 and len(evaluation["top1_per_depth"]) == 3
    assert 0 <= evaluation["mean_masks_in_a_row"] <= 3 * max(evaluation["top1_per_depth"])
