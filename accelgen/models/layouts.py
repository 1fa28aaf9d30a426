"""Where the parts of a HF causal LM live, for the runners that call its modules one by one.

Two descriptions, keyed by `config.model_type`:
- `AlibiLayout`: ALiBi models (Bloom, MPT) add a bias by key position to attention, built by the model's forward
  from a 2-D padding mask, which cannot say that two tree nodes share a position. Their token trees are scored by
  walking the blocks with biases at the tree's positions (`alibi_tree_hidden`).
- `DecoderLayout`: decoders whose layers are two residual sub-blocks (norm -> attention, norm -> MLP), one after
  the other or in parallel, with or without norms after them, for the runners that skip sub-blocks or leave
  the stack early (a layer plan in runner.py, early_exit.py, LayerSkip's and PPD's runners).
A model that is not described is refused by name where a description is needed; no model code is copied.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from accelgen.cache import cache_keyword, layer_windows
from accelgen.errors import InputError
from accelgen.models.block import blocking_mask


@dataclass(frozen=True)
class AlibiLayout:
    decoder: str  # attribute of the causal LM that holds the decoder
    embeddings: str
    embeddings_norm: str | None  # a norm applied right after the embeddings (Bloom), or None
    blocks: str
    final_norm: str
    bias_keyword: str  # the keyword a block takes the ALiBi bias by
    blocked_mask: bool  # the blocks take a bool mask, True where blocked (MPT), rather than an additive one
    # (decoder, length, dtype) -> (heads, 1, length): the model's own ALiBi bias of keys at positions 0..length-1
    key_biases: Callable[[torch.nn.Module, int, torch.dtype], torch.Tensor]


def _bloom_biases(decoder, length: int, dtype: torch.dtype) -> torch.Tensor:
    ones = torch.ones(1, length, dtype=torch.long, device=decoder.word_embeddings.weight.device)
    return decoder.build_alibi_tensor(ones, decoder.num_heads, dtype)


def _mpt_biases(decoder, length: int, dtype: torch.dtype) -> torch.Tensor:
    # MPT's biases run from -(length - 1) to 0 rather than from 0: a constant per query, which softmax ignores
    return decoder.build_mpt_alibi_tensor(decoder.num_heads, length, device=decoder.wte.weight.device).to(dtype)


ALIBI_LAYOUTS = {
    "bloom": AlibiLayout("transformer", "word_embeddings", "word_embeddings_layernorm", "h", "ln_f", "alibi",
                         blocked_mask=False, key_biases=_bloom_biases),
    "mpt": AlibiLayout("transformer", "wte", None, "blocks", "norm_f", "position_bias",
                       blocked_mask=True, key_biases=_mpt_biases),
}


def alibi_layout(config) -> AlibiLayout | None:
    """The ALiBi description of this model, None for a model without one (or whose ALiBi is not described)."""
    return ALIBI_LAYOUTS.get(config.model_type)


def check_tree_positions(config) -> None:
    """A ValueError for an ALiBi model that is not described (Falcon with alibi=True), whose forward would bias
    a tree's nodes by their place in the cache rather than by their depth; its chains are scored right."""
    if getattr(config, "alibi", False) and getattr(config, "model_type", None) not in ALIBI_LAYOUTS:
        raise InputError(f"{config.model_type} with alibi=True: accelgen cannot score token trees with its ALiBi "
                         f"biases (described: {', '.join(ALIBI_LAYOUTS)}); methods that draft chains work")


def alibi_tree_hidden(model, layout: AlibiLayout, token_ids: torch.Tensor, allowed: torch.Tensor,
                      key_positions: torch.Tensor, cache) -> torch.Tensor:
    """The final (normed) hidden states (m, d) of token_ids (m,) appended to `cache`, where new token r attends
    to key c if allowed[r, c] ((m, n) bool over the n = cached + m keys) with the ALiBi bias of key position
    key_positions[c] ((n,) long: a tree node's position is the tree's start + its depth)."""
    decoder = getattr(model, layout.decoder)
    hidden = getattr(decoder, layout.embeddings)(token_ids.to(model.device)[None])  # (1, m, d)
    if layout.embeddings_norm is not None:
        hidden = getattr(decoder, layout.embeddings_norm)(hidden)
    table = layout.key_biases(decoder, int(key_positions.max()) + 1, hidden.dtype)  # (heads, 1, positions)
    bias = table[..., key_positions.to(table.device)]  # (heads, 1, n)
    if layout.blocked_mask:
        mask = ~allowed[None, None].to(model.device)
    else:
        mask = blocking_mask(allowed, hidden.dtype)[None, None].to(model.device)
    for block in getattr(decoder, layout.blocks):
        hidden = block(hidden, layer_past=cache, attention_mask=mask, use_cache=True, **{layout.bias_keyword: bias})[0]
    return getattr(decoder, layout.final_norm)(hidden)[0]


@dataclass(frozen=True)
class DecoderLayout:
    """Where a decoder's parts live. Each layer computes h + attention(attention_norm(h)), then h + mlp(mlp_norm(h))
    of that; or, `parallel`, both from the layer's input: h + attention(attention_norm(h)) + mlp(mlp_norm(h)).
    A norm named None is left out; output norms, where named, normalise a sub-block's output (Gemma 2, OLMo 2).
    The config's multipliers and logit transforms, where it has them, apply too (see `Decoder`)."""

    decoder: str  # attribute of the causal LM that holds the decoder
    layers: str
    embeddings: str
    final_norm: str
    attention_norm: str | None = "input_layernorm"
    attention: str = "self_attn"
    mlp_norm: str | None = "post_attention_layernorm"
    mlp: str = "mlp"
    attention_output_norm: str | None = None
    mlp_output_norm: str | None = None
    rotary: str | None = "rotary_emb"  # the decoder's rotary embedding module, None without one
    learned_positions: str | None = None  # absolute position embeddings added to the tokens' (GPT-2's wpe)
    parallel: bool = False
    attention_options: tuple[tuple[str, object], ...] = ()  # more keywords the attention module requires


LLAMA = DecoderLayout("model", "layers", "embed_tokens", "norm")
GPT2 = DecoderLayout("transformer", "h", "wte", "ln_f", "ln_1", "attn", "ln_2", "mlp", rotary=None,
                     learned_positions="wpe")
GPT_NEOX = DecoderLayout("gpt_neox", "layers", "embed_in", "final_layer_norm", attention="attention")
GEMMA_2 = replace(LLAMA, mlp_norm="pre_feedforward_layernorm", attention_output_norm="post_attention_layernorm",
                  mlp_output_norm="post_feedforward_layernorm")
OLMO_2 = replace(LLAMA, attention_norm=None, mlp_norm=None, attention_output_norm="post_attention_layernorm",
                 mlp_output_norm="post_feedforward_layernorm")
GPT_J = DecoderLayout("transformer", "h", "wte", "ln_f", "ln_1", "attn", "ln_1", "mlp", parallel=True)
FALCON = DecoderLayout("transformer", "h", "word_embeddings", "ln_f", "input_layernorm", "self_attention",
                       "input_layernorm", "mlp", parallel=True, attention_options=(("alibi", None),))

DECODER_LAYOUTS = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "phi3", "olmo", "gemma",
                     "stablelm", "granite"), LLAMA),
    "gemma2": GEMMA_2,
    "olmo2": OLMO_2,
    "cohere": replace(LLAMA, mlp_norm="input_layernorm", parallel=True),
    "gpt2": GPT2,
    "gpt_bigcode": GPT2,
    "gpt_neox": GPT_NEOX,
    "gptj": GPT_J,
}
# the same layouts with use_parallel_residual=True (GPT-NeoX's default, StableLM's option)
PARALLEL_LAYOUTS = {
    "gpt_neox": replace(GPT_NEOX, parallel=True),
    "stablelm": replace(LLAMA, mlp_norm="input_layernorm", parallel=True),  # one norm feeds both
}
# why the other architectures accelgen decodes are not described
NOT_TWO_SUB_BLOCKS = {
    "opt": "its MLP is not one module (fc1, activation, fc2)",
    "falcon": "alibi=True: attention takes ALiBi biases",
    "bloom": "the residual may start after the norm, and attention takes ALiBi biases",
    "mpt": "attention takes ALiBi biases",
    "gemma3_text": "its rotary embeddings differ by layer type",
}


def decoder_layout(config, purpose: str) -> DecoderLayout:
    """The layout of this model's decoder; a ValueError naming the architecture when it has none."""
    model_type = config.model_type
    if model_type == "falcon" and not config.alibi:
        return falcon_layout(config)
    if getattr(config, "use_parallel_residual", False) and model_type in PARALLEL_LAYOUTS:
        return PARALLEL_LAYOUTS[model_type]
    if model_type in DECODER_LAYOUTS:
        return DECODER_LAYOUTS[model_type]
    reason = NOT_TWO_SUB_BLOCKS.get(model_type, "it is not described")
    described = ", ".join(sorted([*DECODER_LAYOUTS, "falcon"]))
    raise InputError(f"{purpose} walks the decoder one sub-block at a time, which {model_type} does not allow "
                     f"({reason}); layouts described: {described}")


def falcon_layout(config) -> DecoderLayout:
    """Falcon's layout, which its options choose: one norm before attention and MLP in parallel (Falcon-7B),
    a norm for each (new_decoder_architecture with num_ln_in_parallel_attn=2: Falcon-40B), or one after the other."""
    if config.new_decoder_architecture and config.num_ln_in_parallel_attn == 2:
        return replace(FALCON, attention_norm="ln_attn", mlp_norm="ln_mlp")
    if config.new_decoder_architecture or config.parallel_attn:
        return FALCON
    return replace(FALCON, mlp_norm="post_attention_layernorm", parallel=False)


class Decoder:
    """A model's decoder reached through its layout, for runners that call its layers' sub-blocks themselves.

    Runners that walk the layers mask full attention only: `check_reach` refuses positions that a sliding
    window would leave out."""

    def __init__(self, model, purpose: str):
        self.model = model
        self.purpose = purpose
        self.layout = decoder_layout(model.config, purpose)
        self.module = getattr(model, self.layout.decoder)
        self.layers = getattr(self.module, self.layout.layers)
        self.window = min((window for window in layer_windows(model.config) if window is not None), default=None)
        # Granite's multipliers of the embeddings and of each sub-block's output (1 in other configs)
        self.embedding_multiplier = getattr(model.config, "embedding_multiplier", 1.0)
        self.residual_multiplier = getattr(model.config, "residual_multiplier", 1.0)

    def check_reach(self, last_position: int) -> None:
        """A ValueError once a new token at last_position would reach past the model's sliding window."""
        if self.window is not None and last_position >= self.window:
            raise InputError(f"{self.purpose} masks full attention only, exact on {self.model.config.model_type} "
                             f"within its sliding window of {self.window} positions; this sequence reaches position "
                             f"{last_position}: ask for fewer tokens, or use a method that runs the whole model")

    def embed(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(1, m, d) input states of token_ids (m,) at positions (1, m)."""
        self.check_reach(int(positions.max()))
        hidden = getattr(self.module, self.layout.embeddings)(token_ids.to(self.model.device)[None])
        if self.layout.learned_positions is not None:
            hidden = hidden + getattr(self.module, self.layout.learned_positions)(positions)
        return hidden * self.embedding_multiplier

    def walk_inputs(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict:
        """The keywords every attention sub-block of one forward takes: positions and their rotary embeddings."""
        rotary = None if self.layout.rotary is None else getattr(self.module, self.layout.rotary)(hidden, positions)
        return {"positions": positions, "position_embeddings": rotary}

    def attention_block(self, layer, hidden: torch.Tensor, *, mask, positions, cache,
                        position_embeddings) -> torch.Tensor:
        """hidden (1, m, d) + the layer's self-attention of it; appends the m positions' keys and values to `cache`."""
        return attention_block(self.layout, layer, hidden, mask=mask, positions=positions, cache=cache,
                               position_embeddings=position_embeddings, scale=self.residual_multiplier)

    def layer(self, layer, hidden: torch.Tensor, *, attend: bool = True, feed: bool = True, **walk) -> torch.Tensor:
        """hidden (1, m, d) through one layer, its attention sub-block left out unless `attend`, its MLP unless
        `feed`; walk: the attention's keywords (mask, positions, cache, position_embeddings)."""
        attended = self.attention_block(layer, hidden, **walk) if attend else hidden
        if not feed:
            return attended
        fed = attended if not self.layout.parallel else hidden  # in parallel, the MLP reads the layer's input
        return attended + mlp_output(self.layout, layer, fed) * self.residual_multiplier

    def through(self, layers, hidden: torch.Tensor, *, positions: torch.Tensor, mask, cache,
                sub_blocks: Callable[[int], tuple[bool, bool]] | None = None) -> torch.Tensor:
        """hidden (b, m, d) at positions (b, m) through the layers `layers` (indices, increasing), each attending to
        its cache and, as `mask` allows ((b or 1, 1, m, cached + m) additive, or None for one token), to the m new
        tokens; every layer appends their keys and values to its cache. The one layer walk of the runners that walk
        the layers themselves, which differ in their plan: which layers, and, by sub_blocks(index) -> (attend,
        feed), which of a layer's sub-blocks run (all of them when None)."""
        self.check_reach(int(positions.max()))
        walk = self.walk_inputs(hidden, positions)
        for index in layers:
            attend, feed = (True, True) if sub_blocks is None else sub_blocks(index)
            hidden = self.layer(self.layers[index], hidden, attend=attend, feed=feed, mask=mask, cache=cache, **walk)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits read from any layer's hidden states (.., d): the final norm, the LM head, then the
        config's logit transforms, where it has them (Gemma 2's soft-capping, Cohere's and Granite's scales);
        float32."""
        logits = self.model.get_output_embeddings()(getattr(self.module, self.layout.final_norm)(hidden))
        config = self.model.config
        if getattr(config, "final_logit_softcapping", None) is not None:
            logits = torch.tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping
        logits = logits * getattr(config, "logit_scale", 1.0) / getattr(config, "logits_scaling", 1.0)
        return logits.float()


def attention_block(layout: DecoderLayout, layer, hidden: torch.Tensor, *, mask, positions, cache,
                    position_embeddings, scale: float = 1.0) -> torch.Tensor:
    """hidden (1, m, d) + scale × the layer's self-attention of it; appends the m positions' keys and values to
    `cache`."""
    attention = getattr(layer, layout.attention)
    attended = attention(_norm(layer, layout.attention_norm, hidden), attention_mask=mask, position_ids=positions,
                         position_embeddings=position_embeddings, **{cache_keyword(attention): cache},
                         **dict(layout.attention_options))[0]
    return hidden + _norm(layer, layout.attention_output_norm, attended) * scale


def mlp_output(layout: DecoderLayout, layer, hidden: torch.Tensor) -> torch.Tensor:
    """(1, m, d): the layer's MLP sub-block of hidden (1, m, d), its norms included, before the residual."""
    return _norm(layer, layout.mlp_output_norm, getattr(layer, layout.mlp)(_norm(layer, layout.mlp_norm, hidden)))


def _norm(layer, name: str | None, hidden: torch.Tensor) -> torch.Tensor:
    return hidden if name is None else getattr(layer, name)(hidden)
