"""Mask tokens on disk and the geometry of their groups: a save/load round trip (with and without prompts and
LoRA), the checks that refuse an unfit artifact, the LoRA hooks acting on the last rows only and removed after,
and the attention pattern of groups hung from a chain and from a tree."""

import pytest
import torch

from accelgen.draft import causal, tree_attention
from accelgen.drafters.mask_drafting import with_groups
from accelgen.heads.mask_tokens import MaskTokens, model_fingerprint
from accelgen.train.bita import BitaConfig, new_bita_tokens
from accelgen.train.space import SpaceConfig, new_space_tokens


@pytest.mark.parametrize("method", ["bita", "space"])
def test_save_and_load_round_trip(tiny_target, tmp_path, method):
    tokens = (new_bita_tokens(tiny_target, BitaConfig()) if method == "bita"
              else new_space_tokens(tiny_target, SpaceConfig(rank=2)))
    tokens.save(tmp_path)
    loaded = MaskTokens.load(tmp_path, tiny_target, method)
    assert loaded.config() == tokens.config() and loaded.fingerprint == model_fingerprint(tiny_target)
    for name, value in tokens.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value)


def test_the_lora_acts_on_the_last_rows_only_and_leaves_no_hook(tiny_target):
    tokens = new_space_tokens(tiny_target, SpaceConfig(rank=2, lora_modules="v_proj"))
    with torch.no_grad():
        for parameter in tokens.lora.parameters():
            parameter.fill_(0.1)
    layer = tiny_target.model.layers[0].self_attn.v_proj
    x = torch.randn(1, 5, tiny_target.config.hidden_size)
    with torch.no_grad(), tokens.lora_on_last(tiny_target, 2):
        adapted = layer(x)
    plain = layer(x).detach()
    assert torch.equal(adapted[:, :3], plain[:, :3]) and not torch.allclose(adapted[:, 3:], plain[:, 3:])
    assert not layer._forward_hooks


def test_groups_hang_from_their_anchor_and_see_their_path():
    """Two tokens (root at row 1) and a draft a(2) ─ b(3), with c(4) a sibling of a; groups of 2 after the root
    and after b."""
    pattern = tree_attention(torch.tensor([-1, 0, -1]), prefix=2)
    allowed = with_groups(pattern, anchors=[1, 3], group=2)
    assert allowed.shape == (9, 9) and torch.equal(allowed[:5, :5], pattern)
    assert allowed[5, :5].tolist() == [True, True, False, False, False]  # after the root: the context only
    assert allowed[7, :5].tolist() == [True, True, True, True, False]  # after b: context, a, b (not c)
    assert allowed[5:7, 5:7].tolist() == causal(2).tolist() and not allowed[7:, 5:7].any()
    assert not allowed[:5, 5:].any()  # nothing real sees a group
