"""MPEE: multi-perspective early exiting (Kong et al. 2022, "Accelerating Inference for Pretrained Language
Models by Unified Multi-Perspective Early Exiting", COLING 2022), for decoding.

Two perspectives on what a token may leave out:

- **vertical** (layers): at each exit layer a trained classifier (heads/mpee.py) reads its own layer's hidden
  state and the features of the exits below it, and says how likely this exit agrees with the full model; the
  token leaves at the first exit where that probability passes `threshold` (1.0 never exits: the full model).
  Its prediction is the exit's, through the exit's trained adapter, the final norm and the LM head; the skipped
  layers' KV come from the copied exited state, as in CALM (models/early_exit.py, propagation "copy").
- **horizontal** (tokens): from layer `prune_from` up, the token attends only to the `keep_ratio` share of the
  context that its query at `prune_from` attends to most; the least-attended positions are masked out of every
  layer from there up. keep_ratio=1.0 (the default) prunes nothing: the vertical perspective alone, exactly.
  Pruning is by mask, so it trades quality only: the attention kernels still read the pruned entries, and the
  prompt's forward goes through every layer in full, as for every early-exit method here.

Both are lossy; `accelgen bench` measures agreement with the full model beside the speed.
The heads come from `accelgen train mpee` (train/mpee.py); heads trained for another model are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from accelgen.drafters.autoregressive import no_drafter
from accelgen.errors import InputError
from accelgen.heads.mpee import TRAIN_COMMAND, MpeeHeads
from accelgen.models.block import blocking_mask
from accelgen.models.early_exit import EarlyExitRunner
from accelgen.models.layouts import Decoder
from accelgen.registry import MethodOptions, MethodSpec, Part, register

# attention with these models' query projection and full rotary embeddings, which the horizontal perspective
# recomputes to see where a token attends (Qwen3's query norm, Phi-3's fused projection are not)
PRUNABLE_MODEL_TYPES = ("llama", "mistral", "qwen2")


def rotate_half(states: torch.Tensor) -> torch.Tensor:
    first, second = states.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def attention_received(decoder: Decoder, index: int, state: torch.Tensor, keys: torch.Tensor,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """(n,) float32: the share of one token's attention at layer `index` that each of the n cached positions gets
    (among them: the token's own key left out), averaged over the heads. state (1, 1, d) is the layer's input, keys (1, kv_heads, n, head_dim) its cached keys
    (rotated), position_embeddings the token's (cos, sin), each (1, 1, head_dim)."""
    layer = decoder.layers[index]
    attention = getattr(layer, decoder.layout.attention)
    normed = getattr(layer, decoder.layout.attention_norm)(state)
    query = attention.q_proj(normed).view(1, 1, -1, attention.head_dim).transpose(1, 2)  # (1, heads, 1, hd)
    cos, sin = (part[:, None] for part in position_embeddings)
    query = query * cos + rotate_half(query) * sin
    keys = keys.repeat_interleave(query.shape[1] // keys.shape[1], dim=1)  # grouped-query: one key head per group
    scores = (query @ keys.transpose(-1, -2)).float() * attention.scaling  # (1, heads, 1, n)
    return scores.softmax(dim=-1).mean(dim=1)[0, 0]


def least_attended_mask(received: torch.Tensor, keep_ratio: float, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, 1, n + 1) additive mask keeping the ceil(keep_ratio · n) positions that received the most attention
    (received (n,)), and the token itself (the last column)."""
    count = received.shape[0]
    kept = torch.zeros(count + 1, dtype=torch.bool)
    kept[received.topk(max(1, math.ceil(keep_ratio * count))).indices.cpu()] = True
    kept[-1] = True
    return blocking_mask(kept[None], dtype)[None, None].to(received.device)


@dataclass
class MultiPerspectiveExit:
    """The exit rule, and the adapter the runner reads exits through (`adapt`). One decoding step walks the layers
    in order: `walked` and `context` hold what this step's walk has computed so far (an exit's features are
    carried to the exits above it; the pruning mask chosen at prune_from serves the layers above), and are
    started afresh at the first exit layer and at prune_from, which every step goes through."""

    heads: MpeeHeads
    threshold: float
    keep_ratio: float
    prune_from: int
    decoder: Decoder
    walked: dict[int, torch.Tensor] = field(default_factory=dict)  # exit layer -> its features (r,), this step
    context: torch.Tensor | None = None  # this step's mask from prune_from up

    def first_layer(self, position: int) -> int:
        return 0

    def should_exit(self, token, layer, hidden, previous, logits) -> bool:
        if layer not in self.heads.layers:
            return False
        below = self.heads.below(layer)
        if below is None:
            self.walked = {}
        with torch.no_grad():
            features = self.walked[layer] = self.heads.features(layer, hidden, self.walked.get(below))
            return float(self.heads.confidence(layer, features)) > self.threshold  # strictly: 1.0 never exits

    def adapt(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (1, 1, d) at the exit the token leaves by, through that exit's adapter (unchanged at the last layer)."""
        features = self.walked.get(layer) if layer in self.heads.layers else None
        if features is None:
            return hidden
        with torch.no_grad():
            return self.heads.adapt(layer, hidden, features)

    def context_mask(self, layer: int, state: torch.Tensor, cache, walk: dict) -> torch.Tensor | None:
        if self.keep_ratio >= 1.0 or layer < self.prune_from:
            return None
        if layer == self.prune_from:
            keys = cache.layers[layer].keys
            received = attention_received(self.decoder, layer, state, keys, walk["position_embeddings"])
            self.context = least_attended_mask(received, self.keep_ratio, state.dtype)
        length = cache.layers[layer].keys.shape[-2]
        if self.context is None or self.context.shape[-1] != length + 1:
            raise InputError(f"mpee: layer {layer} holds {length} positions, layer {self.prune_from} held "
                             f"{self.context.shape[-1] - 1 if self.context is not None else 'none'}")
        return self.context


@dataclass(frozen=True)
class MpeeOptions(MethodOptions):
    heads: str | None = None  # the trained heads' folder (`accelgen train mpee --out FOLDER`)
    threshold: float = 0.9  # exit once an exit's classifier gives agreement above this (1.0: never)
    keep_ratio: float = 1.0  # share of the context upper layers attend to (1.0: all of it)
    prune_from: int | None = None  # the first layer that prunes (None: the first exit layer)

    def __post_init__(self):
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not 0.0 <= self.threshold <= 1.0:
            raise InputError(f"mpee: threshold must be a number in [0, 1], not {self.threshold!r}")
        if isinstance(self.keep_ratio, bool) or not isinstance(self.keep_ratio, (int, float)) \
                or not 0.0 < self.keep_ratio <= 1.0:
            raise InputError(f"mpee: keep_ratio must be a number in (0, 1] (1: prune nothing), not {self.keep_ratio!r}")


def make_rule(model, heads: MpeeHeads, *, threshold: float, keep_ratio: float = 1.0,
              prune_from: int | None = None) -> MultiPerspectiveExit:
    heads.check_fits(model)
    layer_count = model.config.num_hidden_layers
    prune_from = heads.layers[0] if prune_from is None else prune_from
    if isinstance(prune_from, bool) or not isinstance(prune_from, int) or not 0 <= prune_from < layer_count:
        raise InputError(f"mpee: prune_from must be a layer, 0..{layer_count - 1}, not {prune_from!r}")
    decoder = Decoder(model, "mpee")
    if keep_ratio < 1.0 and model.config.model_type not in PRUNABLE_MODEL_TYPES:
        raise InputError(f"mpee: keep_ratio < 1 reads attention from {', '.join(PRUNABLE_MODEL_TYPES)} models' query "
                         f"projections; {model.config.model_type} is not one (keep_ratio=1 works)")
    return MultiPerspectiveExit(heads, float(threshold), float(keep_ratio), prune_from, decoder)


def make_runner(model, *, heads: str | None, **rule) -> EarlyExitRunner:
    if not heads:
        raise InputError(f"mpee needs trained heads: heads=FOLDER, from `{TRAIN_COMMAND} --out FOLDER`")
    exit_rule = make_rule(model, MpeeHeads.load(heads, model), **rule)
    return EarlyExitRunner(model, exit_rule, "copy", heads=exit_rule)  # the runner reads exits through the rule


register(
    MethodSpec(
        name="mpee",
        family="early-exit",
        lossless="lossy",
        paper="Kong et al. 2022, COLING 2022 (MPEE)",
        summary="multi-perspective early exit: exit classifiers that reuse the lower exits' features, trained by "
                "weighted self-distillation (vertical), and upper layers that skip the least-attended context "
                "(horizontal)",
        drafter=Part(no_drafter),
        runner=Part(lambda model, options: make_runner(model, **options.as_dict()), MpeeOptions),
    )
)
