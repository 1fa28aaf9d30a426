"""The EAGLE-3 head (Li et al. 2025, arXiv:2503.01840): one decoder layer over fused features of a low, a middle
and a high layer of the target, drafting from its own LM head over a draft vocabulary.

Where EAGLE-1 (heads/eagle.py) predicts the target's next *final* feature and reads it through the target's LM
head, EAGLE-3 gives that up ("no feature regression"):

- The input is `fc(concat(h_low, h_mid, h_high))` (3d → d): the target's residual stream entering three of its
  layers, by default 2, L // 2 and L - 3 of its L layers as vLLM picks them (index i is what enters layer i, 0 the
  embeddings: HF's `hidden_states[i]`).
- The layer takes 2d: the token's embedding and the hidden state, each through its own norm (`input_layernorm`,
  `hidden_norm`), concatenated for q, k and v; the residual is the hidden state alone.
- Its output goes through its own final `norm` and `lm_head` over the draft vocabulary; `d2t[i]` is the offset
  from draft id i to its target id (target = i + d2t[i]) and `t2d` marks the target ids in the draft vocabulary,
  as the EAGLE-3 checkpoints store them.
- Drafting goes on from the layer's own output (before the norm) in place of the fused features, and training
  unrolls the head that way over several steps ("training-time test", train/eagle.py).

The weight names are those of the EAGLE-3 checkpoints that vLLM's llama_eagle3.py loads (`midlayer.*`, `fc`,
`norm`, `lm_head`, `d2t`, `t2d`), so the export writes the state dict as it is.
"""

from __future__ import annotations

import torch

from accelgen.cache import cache_keyword
from accelgen.errors import InputError
from accelgen.heads.eagle_common import NAME, head_config
from accelgen.heads.io import save_heads

RECIPE = "eagle3"


def default_target_layers(layer_count: int) -> tuple[int, int, int]:
    """The residual-stream indices the head reads: vLLM's (2, L // 2, L - 3) for a model of L >= 6 layers; a
    smaller model's first, middle and last layer inputs."""
    if layer_count >= 6:
        return 2, layer_count // 2, layer_count - 3
    return 1, max(1, layer_count // 2), max(1, layer_count - 1)


class MidLayer(torch.nn.Module):
    """The EAGLE-3 decoder layer: attention over [norm(token embedding), norm(hidden)] (2d), residual on hidden."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_idx=0)
        attention = self.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # they read embeds and hidden state side by side
            setattr(attention, name, torch.nn.Linear(2 * d, getattr(attention, name).out_features, bias=False))
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(d, eps=eps)
        self.hidden_norm = LlamaRMSNorm(d, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps=eps)

    def forward(self, token_embeds, hidden, position_embeddings, mask, cache):
        """(b, m, d) the layer's output from token_embeds and hidden (b, m, d)."""
        joined = torch.cat([self.input_layernorm(token_embeds), self.hidden_norm(hidden)], dim=-1)
        attended, _ = self.self_attn(joined, position_embeddings=position_embeddings, attention_mask=mask,
                                     **{cache_keyword(self.self_attn): cache})
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(torch.nn.Module):
    recipe = RECIPE

    def __init__(self, config: dict, base_model: str = "", layer_count: int = 0, draft_vocab: int = 0,
                 target_layers: list[int] | None = None, recipe: str = RECIPE):
        """config: the head's LlamaConfig as a dict (`head_config(target.config).to_dict()`); draft_vocab: the size
        of its draft vocabulary (0: the whole vocabulary); target_layers: the three residual-stream indices it reads."""
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        if recipe != RECIPE:
            raise InputError(f"an EAGLE-3 head's recipe is {RECIPE!r}, got {recipe!r}")
        self.config = LlamaConfig(**config)
        self.config._attn_implementation = "sdpa"
        self.base_model, self.layer_count = base_model, layer_count
        self.target_layers = tuple(target_layers or default_target_layers(layer_count))
        if len(self.target_layers) != 3:
            raise InputError(f"an EAGLE-3 head reads three layers, got {self.target_layers}")
        d, vocab = self.config.hidden_size, self.config.vocab_size
        drafted = draft_vocab or vocab
        self.fc = torch.nn.Linear(3 * d, d, bias=False)
        self.midlayer = MidLayer(self.config)
        self.norm = LlamaRMSNorm(d, eps=self.config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(d, drafted, bias=False)
        self.rotary = LlamaRotaryEmbedding(self.config)
        self.register_buffer("d2t", torch.zeros(drafted, dtype=torch.long))  # target id = draft id + d2t
        self.register_buffer("t2d", torch.ones(vocab, dtype=torch.bool))  # target ids in the draft vocabulary

    @property
    def draft_ids(self) -> torch.Tensor:
        """(V',) the target id of each draft id."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """(.., d) the head's input from the target's three layers' hidden states (.., 3d)."""
        return self.fc(features.to(self.fc.weight.dtype))

    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """(b, m, d) the layer's outputs (before the final norm) for token_embeds (b, m, d) of x_{t+1} and hidden
        (b, m, d): fused target features, or the head's own earlier outputs; positions (b, m); mask additive
        (b or 1, 1, m, cached + m); cache: a DynamicCache the new keys and values go into."""
        token_embeds = token_embeds.to(self.fc.weight.dtype)
        return self.midlayer(token_embeds, hidden.to(token_embeds.dtype), self.rotary(hidden, positions), mask, cache)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(.., V') float32 logits over the draft vocabulary from the layer's outputs (.., d)."""
        return self.lm_head(self.norm(hidden.to(self.fc.weight.dtype))).float()

    def vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(.., vocab) float32 logits over the target's vocabulary: -inf outside the draft vocabulary."""
        drafted = self.draft_logits(hidden)
        full = torch.full((*drafted.shape[:-1], self.config.vocab_size), float("-inf"), device=drafted.device)
        full[..., self.draft_ids] = drafted
        return full

    def label_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """target ids (..) as draft ids; -100 (cross-entropy's ignore_index) outside the draft vocabulary."""
        index = torch.full((self.config.vocab_size,), -100, dtype=torch.long)
        index[self.draft_ids.cpu()] = torch.arange(len(self.d2t))
        return index[tokens.cpu()].to(tokens.device)

    def set_draft_vocabulary(self, vocab: torch.Tensor, lm_head=None) -> None:
        """Draft from vocab (V',) sorted target ids; lm_head (the target's): its rows start the head's own."""
        with torch.no_grad():
            self.d2t.copy_(vocab - torch.arange(len(vocab)))
            self.t2d.zero_()
            self.t2d[vocab] = True
            if lm_head is not None:
                self.lm_head.weight.copy_(lm_head.weight.detach()[vocab.to(lm_head.weight.device)])

    def describe_shape(self) -> dict:
        return {"hidden_size": self.config.hidden_size, "layer_count": self.layer_count,
                "vocab_size": self.config.vocab_size, "intermediate_size": self.config.intermediate_size}

    def save(self, folder) -> None:
        save_heads(self, folder, NAME, {"recipe": RECIPE, "config": self.config.to_dict(), "base_model": self.base_model,
                                        "layer_count": self.layer_count, "draft_vocab": len(self.d2t),
                                        "target_layers": list(self.target_layers)})


def new_eagle3_head(model, vocab: torch.Tensor | None = None, target_layers=None) -> Eagle3Head:
    """An untrained EAGLE-3 head for the target `model`, drafting from vocab (sorted target ids; None: all). It
    starts as the target's "logit lens" at its highest read layer: fc passes that layer's state, the attention and
    MLP add nothing, and the norm and LM head rows are the target's own."""
    config = model.config
    head = Eagle3Head(head_config(config).to_dict(), str(getattr(model, "name_or_path", "")),
                      config.num_hidden_layers, 0 if vocab is None else len(vocab), target_layers)
    d = config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * d:] = torch.eye(d)
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
        final_norm = getattr(model.base_model, "norm", None)
        if final_norm is not None and getattr(final_norm, "weight", None) is not None:
            head.norm.weight.copy_(final_norm.weight.detach().float())
    head.set_draft_vocabulary(torch.arange(config.vocab_size) if vocab is None else vocab,
                              model.get_output_embeddings())
    return head
