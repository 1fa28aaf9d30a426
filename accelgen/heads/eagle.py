"""The EAGLE head (Li et al. 2024, arXiv:2401.15077): one Llama decoder layer that predicts the target's next
feature.

The target's *feature* f_t is its last hidden state at position t, after the final norm: what its LM head
reads to guess token t + 1. The head takes f_t and the embedding of the token x_{t+1} that followed, fuses
them with fc (2d → d), and runs one Llama decoder layer to predict the next feature f_{t+1}. The target's own
LM head then turns that prediction into a guess of x_{t+2}. While drafting, the head goes on autoregressively
on its own predicted features (drafters/eagle.py); `accelgen train eagle` trains it (train/eagle.py).

As in EAGLE, and in the layout vLLM loads (`accelgen export vllm`):

- the layer has no input norm, because its input is made of normed features;
- there is no final norm;
- the target's embedding and LM head are shared and frozen.

The layer is the target's shape: its width, heads, MLP size and rotary settings.

This is the `eagle1` recipe. The `eagle3` recipe's head (heads/eagle3.py) is saved in the same files with
`"recipe": "eagle3"` in its JSON; `EagleHead.load` returns whichever head a folder holds.
"""

from __future__ import annotations

import torch

from accelgen.cache import cache_keyword
from accelgen.heads.eagle3 import Eagle3Head
from accelgen.heads.eagle_common import NAME, RECIPES, head_config, saved_recipe
from accelgen.heads.io import load_heads, save_heads

# heads/eagle_common.py's names too, importable from here as before
__all__ = ["NAME", "RECIPES", "EagleHead", "head_config", "new_head", "saved_recipe"]


class EagleHead(torch.nn.Module):
    recipe = "eagle1"
    target_layers = None  # it reads the target's final features, not chosen layers' (EAGLE-3)

    def __init__(self, config: dict, base_model: str = "", layer_count: int = 0, draft_vocab: int = 0):
        """config: the head's LlamaConfig as a dict (`head_config(target.config).to_dict()`); draft_vocab: the
        size of the vocabulary it drafts from (0: the whole vocabulary)."""
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.config = LlamaConfig(**config)
        self.config._attn_implementation = "sdpa"
        self.base_model, self.layer_count = base_model, layer_count
        d = self.config.hidden_size
        self.fc = torch.nn.Linear(2 * d, d, bias=False)
        self.layer = LlamaDecoderLayer(self.config, layer_idx=0)
        self.layer.input_layernorm = torch.nn.Identity()  # its input is made of normed features (EAGLE, vLLM)
        self.rotary = LlamaRotaryEmbedding(self.config)
        # the token ids drafts are drawn from (FR-Spec's idea: on a CPU the LM head is most of a draft step's
        # cost, and a few thousand frequent tokens carry nearly all of the text); empty: all of them
        self.register_buffer("vocab", torch.zeros(draft_vocab, dtype=torch.long))
        with torch.no_grad():  # untrained, the head passes the feature through: training starts from there
            self.fc.weight.zero_()
            self.fc.weight[:, d:] = torch.eye(d)
            self.layer.self_attn.o_proj.weight.zero_()
            self.layer.mlp.down_proj.weight.zero_()

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """(b, m, d) predicted features f_{t+1} from token_embeds (b, m, d) of x_{t+1} and features (b, m, d) f_t,
        at positions (b, m); mask (b or 1, 1, m, cached + m) additive, None for a single token; cache: a
        DynamicCache the new keys and values are appended to."""
        hidden = self.fc(torch.cat([token_embeds, features], dim=-1).to(self.fc.weight.dtype))
        return self.layer(hidden, attention_mask=mask, position_ids=positions, **{cache_keyword(self.layer): cache},
                          use_cache=cache is not None, position_embeddings=self.rotary(hidden, positions))

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The head's input from the target's features (.., d): they are its input as they are."""
        return features

    def describe_shape(self) -> dict:
        return {"hidden_size": self.config.hidden_size, "layer_count": self.layer_count,
                "vocab_size": self.config.vocab_size, "intermediate_size": self.config.intermediate_size}

    def save(self, folder) -> None:
        save_heads(self, folder, NAME, {"config": self.config.to_dict(), "base_model": self.base_model,
                                        "layer_count": self.layer_count, "draft_vocab": len(self.vocab)})

    @classmethod
    def load(cls, folder, model=None):
        """The head saved in folder, of either recipe (an Eagle3Head for "eagle3"); with a model, checked to fit it
        and cast to its dtype."""
        head_class = Eagle3Head if saved_recipe(folder) == "eagle3" else cls
        head = load_heads(head_class, folder, NAME, "accelgen train eagle", model)
        return head if model is None else head.to(model.dtype)


def new_head(model) -> EagleHead:
    """An untrained head for the target `model`."""
    return EagleHead(head_config(model.config).to_dict(), str(getattr(model, "name_or_path", "")),
                     model.config.num_hidden_layers)
