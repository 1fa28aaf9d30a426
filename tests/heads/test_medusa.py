"""Medusa heads: untrained, every head repeats the target's own next-token guess."""

import torch

from accelgen.heads.medusa import MedusaHeads


def test_untrained_heads_repeat_the_targets_next_token_guess(make_tiny_model):
    model = make_tiny_model("qwen2", seed=2)
    features = torch.randn(3, 64)
    heads = MedusaHeads(2, 64)
    logits = heads.lm_head(model)(heads(features))  # (2, 3, vocab)
    expected = model.lm_head(features).float()
    torch.testing.assert_close(logits[0], expected)
    torch.testing.assert_close(logits[1], expected)
