"""A Llama-style decoder walked layer by layer over whole sequences, without a cache: the trainers of exits and
heads (train/) read every layer's output through these helpers, which call the HF model's own modules, so no
model code is copied. Runners that walk the layers during generation (a layer plan in models/runner.py, early
exit, LayerSkip's shared cache, PPD) reach other layouts too, through models/layouts.py.

Supported: decoder layers of the Llama family shape (`input_layernorm`, `self_attn`, `post_attention_layernorm`,
`mlp`), as in Llama, Qwen2, Mistral and SmolLM2.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from accelgen.errors import InputError
from accelgen.models.block import Block

SUB_BLOCKS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def llama_decoder(model, purpose: str):
    """model.model, checked to have the parts a layer-by-layer walk calls; a clear error otherwise."""
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None or not all(hasattr(decoder, name) for name in ("embed_tokens", "norm", "rotary_emb")) \
            or not all(hasattr(layer, name) for layer in layers for name in SUB_BLOCKS):
        raise InputError(f"{purpose} needs a Llama-style decoder (model.model.layers with {', '.join(SUB_BLOCKS)}); "
                         f"{type(model).__name__} is not one")
    return decoder


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
    walk = dict(attention_mask=Block.chain(0, length).mask(hidden.dtype, model.device), position_ids=positions,
                position_embeddings=decoder.rotary_emb(hidden, positions))
    for index, layer in enumerate(decoder.layers):
        output = layer(hidden, **walk)
        output = output[0] if isinstance(output, tuple) else output
        if passed_over is not None:
            output = torch.where(passed_over(index).to(model.device)[:, None, None], hidden, output)
        hidden = output
        yield hidden
