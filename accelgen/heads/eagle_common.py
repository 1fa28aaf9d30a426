"""What the two EAGLE recipes' heads share (heads/eagle.py: EAGLE-1, heads/eagle3.py: EAGLE-3): the name of their
files, the recipe a saved folder holds, and the one-layer LlamaConfig shaped like the target's layers.

Both recipes are saved in the same files, the JSON naming its recipe; `EagleHead.load` (heads/eagle.py) reads that
recipe and returns the head of either kind.
"""

from __future__ import annotations

import json
from pathlib import Path

from accelgen.errors import InputError

NAME = "eagle_head"


def head_config(target_config):
    """The LlamaConfig of a one-layer head shaped like the target's layers."""
    from transformers import LlamaConfig

    heads = target_config.num_attention_heads
    config = LlamaConfig(
        vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        hidden_act=target_config.hidden_act, rms_norm_eps=target_config.rms_norm_eps,
        max_position_embeddings=target_config.max_position_embeddings,
        rope_parameters=dict(target_config.rope_parameters), attention_bias=False,
    )
    config._attn_implementation = "sdpa"
    return config


RECIPES = ("eagle1", "eagle3")


def saved_recipe(folder) -> str:
    """The recipe of the head saved in folder ("eagle1" when its JSON names none, as before EAGLE-3)."""
    path = Path(folder).expanduser() / f"{NAME}.json"
    try:
        recipe = json.loads(path.read_text()).get("recipe", "eagle1")
    except (OSError, ValueError, AttributeError):
        return "eagle1"  # missing or unreadable: load_heads names the problem
    if recipe not in RECIPES:
        raise InputError(f"{path} names the recipe {recipe!r}; accelgen knows {', '.join(RECIPES)}")
    return recipe
