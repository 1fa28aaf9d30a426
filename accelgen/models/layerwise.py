"""A Llama-style decoder called one sub-block at a time, for runners that leave some of it out.

Layer skipping (layer_skip.py, the self-speculative draft) and early exit (early_exit.py) walk the decoder
themselves instead of calling `model.forward`; both call the HF model's own modules through these helpers,
so no model code is copied.

Supported: decoder layers of the Llama family shape (`input_layernorm`, `self_attn`, `post_attention_layernorm`,
`mlp`), as in Llama, Qwen2, Mistral and SmolLM2.
"""

from __future__ import annotations

import torch

SUB_BLOCKS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def llama_decoder(model, purpose: str):
    """model.model, checked to have the parts a layer-by-layer walk calls; a clear error otherwise."""
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None or not all(hasattr(decoder, name) for name in ("embed_tokens", "norm", "rotary_emb")) \
            or not all(hasattr(layer, name) for layer in layers for name in SUB_BLOCKS):
        raise ValueError(f"{purpose} needs a Llama-style decoder (model.model.layers with {', '.join(SUB_BLOCKS)}); "
                         f"{type(model).__name__} is not one")
    return decoder


def attention_block(layer, hidden: torch.Tensor, *, mask, positions, cache, position_embeddings) -> torch.Tensor:
    """hidden (1, m, d) + the layer's self-attention of it; appends the m positions' keys and values to `cache`."""
    attended, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden), attention_mask=mask,
                                  position_ids=positions, past_key_values=cache,
                                  position_embeddings=position_embeddings)
    return hidden + attended


def mlp_block(layer, hidden: torch.Tensor) -> torch.Tensor:
    """hidden (1, m, d) + the layer's MLP of it."""
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def exit_logits(model, decoder, hidden: torch.Tensor) -> torch.Tensor:
    """Next-token logits read from any layer's hidden states (.., d): the final norm, then the LM head; float32."""
    return model.lm_head(decoder.norm(hidden)).float()
