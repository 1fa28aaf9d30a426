"""EAGLE (Li et al. 2024) with EAGLE-2's dynamic trees: drafts from a one-layer head that autoregresses on the
target's own features, trained by `accelgen train eagle` (train/eagle.py).

The target's runner keeps the feature (final normed hidden state) of every cached position
(`ModelRunner.keep_hidden`). The cache holds every committed token but the root, so before each draft the
head catches up on the pairs (f_j, x_{j+1}) it has not seen. Its last output is its guess of the root's
feature, and the target's LM head turns that guess into the distribution of the first draft token.

Deeper levels feed each node's token together with its parent's *predicted* feature. Their rows are scored
under tree attention and then cut from the head's cache: the head's cache only ever keeps pairs built from
the target's true features.

The tree is grown by the shared tree drafter (drafters/draft_tree.py), with the head as its scorer:

- **Dynamic** (EAGLE-2, the default): at each of `depth` levels, the `width` nodes with the highest
  cumulative draft probability get `width` children each. For greedy decoding, the finished tree is reranked
  to its `max_nodes` most probable nodes.
- **Static**: given by `paths`, as Medusa's choices.

An EAGLE-3 head (heads/eagle3.py, `accelgen train eagle --recipe eagle3`) drafts the same way, with three
differences: the runner keeps the residual stream entering three of the target's layers rather than its final
features (`ModelRunner.keep_layers`, set here as the drafter is built), the head fuses them (fc) before its
layer, and it reads its own outputs through its own LM head over its draft vocabulary (d2t).

The head drafts from its draft vocabulary (see train/eagle.py): only those rows of the LM head are computed.
Greedy verification keeps exactly the target's greedy tokens. Sampling draws each node's children i.i.d.
from the head's distribution and verifies with SpecInfer's multi-step rule, so the output follows the
target's distribution exactly (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelgen import cache as kv
from accelgen.draft import ROOT, causal, to_device, tree_attention
from accelgen.drafters.base import BuildContext
from accelgen.drafters.draft_tree import DraftTreeDrafter, with_ancestors
from accelgen.errors import InputError
from accelgen.heads.eagle import EagleHead
from accelgen.heads.lm_head import DraftLMHead
from accelgen.heads.shipping import shipped_drafters, shipped_head
from accelgen.models.block import Block
from accelgen.models.embedded import EMBEDDED_MODELS
from accelgen.models.runner import ModelRunner
from accelgen.registry import MethodOptions, MethodSpec, Part, register


def reads_layers(target: ModelRunner, head) -> None:
    """Have the target's runner keep what the head reads: its final features (EAGLE-1, as the loop set), or the
    residual stream entering the EAGLE-3 head's three layers in their place."""
    if head.target_layers is None:
        return
    if not hasattr(target, "keep_layers"):
        raise InputError(f"an EAGLE-3 head reads the target's layers {list(head.target_layers)}, which only a "
                         f"PyTorch model's runner keeps; load the target in a PyTorch format, not with llama.cpp")
    target.keep_layers = head.target_layers
    target.keep_hidden = False  # the final features are not read


class EagleScorer:
    """Draft logits from an EAGLE head (either recipe) over the target's features (the scorer of DraftTreeDrafter)."""

    def __init__(self, target: ModelRunner, head):
        target_model = target.model
        self.embed = target_model.get_input_embeddings()
        # EAGLE-1 reads its predicted features through the target's LM head, EAGLE-3 through its own
        self.lm_head = (DraftLMHead(target_model.get_output_embeddings(), head.vocab) if head.target_layers is None
                        else head.vocab_logits)
        self.head = head
        self.max_positions = getattr(target_model.config, "max_position_embeddings", None) or 1 << 30
        self.cache = kv.new_cache(head.config)
        self.fed = 0  # positions the head's cache holds: pairs (f_j, x_{j+1}) for j < fed
        self.root_feature: torch.Tensor | None = None  # (d,) the head's guess of the root's feature
        self.predicted: dict[int, torch.Tensor] = {}  # node -> (d,) the head's guess of its feature
        self.target = target  # its runner keeps the features the head reads (MethodSpec.reads_target_hidden)

    @torch.inference_mode()
    def root_logits(self, context: list[int]) -> torch.Tensor | None:
        """(vocab,) the head's logits for the first draft token; None before the target has any features."""
        # (cached, d) final features, or (cached, 3d) three layers' states: every committed position but the root
        features = self.target.hidden if self.head.target_layers is None else self.target.layer_hidden
        if features is None or len(features) == 0:
            return None
        if self.fed > len(features):  # the target's cache was cut back (a reset): start the head over
            kv.crop(self.cache, 0)
            self.fed = 0
        if self.fed < len(features):
            new = len(features) - self.fed
            tokens = torch.tensor(context[self.fed + 1 : len(features) + 1])  # x_{j+1} for the new pairs
            output = self._forward(tokens, self.head.fuse(features[self.fed :]), causal(new))
            self.fed = len(features)
            self.root_feature = output[-1]
        self.predicted = {}
        return self.lm_head(self.root_feature[None])[0]

    @torch.inference_mode()
    def score(self, tokens: torch.Tensor, parents: list[int], nodes: list[int]) -> torch.Tensor:
        """(len(nodes), vocab) the head's logits after each of nodes: one tree forward over them and their
        ancestors, each fed its token and its parent's predicted feature. tokens: (n,) long, every node's token
        (on any device; a list too)."""
        tokens = torch.as_tensor(tokens)
        kept, kept_parents = with_ancestors(parents, nodes)
        parent_features = torch.stack([self.root_feature if parents[node] == ROOT else self.predicted[parents[node]]
                                       for node in kept])
        output = self._forward(tokens.index_select(0, to_device(kept, tokens.device)), parent_features,
                               tree_attention(kept_parents)[1:, 1:])
        kv.crop(self.cache, self.fed)  # keep only pairs of true features
        self.predicted.update(zip(kept, output))
        return self.lm_head(output.index_select(0, to_device([kept.index(node) for node in nodes], output.device)))

    def _forward(self, tokens: torch.Tensor, features: torch.Tensor, pattern: torch.Tensor) -> torch.Tensor:
        """(m, d) predicted features for tokens (m,) with features (m, d), placed after the cached pairs as
        pattern (m, m) bool allows (causal, or a tree: position = cached + depth - 1)."""
        block = Block(self.fed, pattern)
        positions = block.positions[None].to(self.head.fc.weight.device, non_blocking=True)
        features = features.to(self.head.fc.weight.dtype)
        mask = block.walk_mask(features.dtype, features.device)
        embeds = self.embed(tokens.to(features.device, non_blocking=True))[None]
        return self.head(embeds, features[None], positions, mask, self.cache)[0]


@dataclass(frozen=True)
class EagleOptions(MethodOptions):
    heads: str | None = None  # the trained head's folder (None: the head shipped for an embedded target)
    width: int = 8  # the dynamic tree: nodes expanded per level ...
    depth: int = 5  # ... levels ...
    max_nodes: int = 32  # ... and the best nodes kept
    paths: list[list[int]] | None = None  # a static tree instead: its paths


def _make_eagle(build: BuildContext, options: EagleOptions) -> DraftTreeDrafter:
    folder = options.heads or shipped_head(build.target_model, "eagle")
    if folder is None:
        shipping = [name for name in EMBEDDED_MODELS if "eagle" in shipped_drafters(name)]
        raise InputError(f"eagle needs a trained EAGLE head: heads=FOLDER (from `accelgen train eagle --model M "
                         f"--out FOLDER`); heads ship only for the embedded {', '.join(shipping) or 'none'}")
    head = EagleHead.load(folder, build.target_model)  # either recipe, checked to fit the target
    reads_layers(build.target, head)
    scorer = EagleScorer(build.target, head)
    if options.paths:
        return DraftTreeDrafter(scorer, build.sampling, build.generator, paths=options.paths)
    return DraftTreeDrafter(scorer, build.sampling, build.generator, width=options.width, depth=options.depth,
                            max_nodes=options.max_nodes)


register(
    MethodSpec(
        name="eagle",
        family="speculative",
        lossless="distribution-exact",
        paper="Li et al. 2024, arXiv:2401.15077 (EAGLE); arXiv:2406.16858 (EAGLE-2); arXiv:2503.01840 (EAGLE-3)",
        summary="a one-layer head autoregresses on the target's own features (EAGLE-1) or on three of its layers "
                "fused (EAGLE-3, its own draft-vocabulary LM head); EAGLE-2's dynamic tree (width x depth, best "
                "max_nodes kept) verified in one forward",
        drafter=Part(_make_eagle, EagleOptions),
        needs=("heads",),
        reads_target_hidden=True,
    )
)
