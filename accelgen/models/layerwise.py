"""A Llama-style decoder called one sub-block at a time, for code that leaves some of it out.

PPD (exits/ppd.py), Medusa's check and the trainers of exits and heads (train/) walk `model.model` themselves
through these helpers, which call the HF model's own modules, so no model code is copied. The runners that skip
sub-blocks or exit early (layer_skip.py, early_exit.py, exit_draft.py) reach other layouts too, through
models/layouts.py, of which these helpers are the Llama case.

Supported: decoder layers of the Llama family shape (`input_layernorm`, `self_attn`, `post_attention_layernorm`,
`mlp`), as in Llama, Qwen2, Mistral and SmolLM2.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from accelgen.models import layouts

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
    return layouts.attention_block(layouts.LLAMA, layer, hidden, mask=mask, positions=positions, cache=cache,
                                   position_embeddings=position_embeddings)


def mlp_block(layer, hidden: torch.Tensor) -> torch.Tensor:
    """hidden (1, m, d) + the layer's MLP of it."""
    return layouts.mlp_block(layouts.LLAMA, layer, hidden)


def through_layers(decoder, layers, hidden: torch.Tensor, *, positions: torch.Tensor, mask, cache) -> torch.Tensor:
    """hidden (1, m, d) at positions (1, m) through the decoder layers `layers` (indices, increasing), each
    attending to its cache and, as `mask` allows ((1, 1, m, cached + m) additive, or None for one token),
    to the m new tokens; every layer appends their keys and values to its cache."""
    position_embeddings = decoder.rotary_emb(hidden, positions)
    for index in layers:
        layer = decoder.layers[index]
        hidden = attention_block(layer, hidden, mask=mask, positions=positions, cache=cache,
                                 position_embeddings=position_embeddings)
        hidden = mlp_block(layer, hidden)
    return hidden


def exit_logits(model, decoder, hidden: torch.Tensor) -> torch.Tensor:
    """Next-token logits read from any layer's hidden states (.., d): the final norm, then the LM head; float32."""
    return model.lm_head(decoder.norm(hidden)).float()


def layer_outputs(model, decoder, token_ids: torch.Tensor,
                  passed_over: Callable[[int], torch.Tensor] | None = None) -> Iterator[torch.Tensor]:
    """Each decoder layer's output (b, n, d) over whole sequences token_ids (b, n), without a cache (training and
    evaluation of exits). passed_over(layer) -> (b,) bool: sequences whose input skips that layer (layer dropout)."""
    token_ids = token_ids.to(model.device)
    hidden = decoder.embed_tokens(token_ids)
    length = token_ids.shape[1]
    positions = torch.arange(length, device=model.device)[None]
    blocked = torch.ones(length, length, dtype=torch.bool, device=model.device).triu(1)
    mask = torch.zeros(length, length, dtype=hidden.dtype, device=model.device).masked_fill(blocked, torch.finfo(hidden.dtype).min)
    walk = dict(attention_mask=mask[None, None], position_ids=positions,
                position_embeddings=decoder.rotary_emb(hidden, positions))
    for index, layer in enumerate(decoder.layers):
        output = layer(hidden, **walk)
        output = output[0] if isinstance(output, tuple) else output
        if passed_over is not None:
            output = torch.where(passed_over(index).to(model.device)[:, None, None], hidden, output)
        hidden = output
        yield hidden
