"""The target model with some of its attention and MLP sub-layers skipped: a cheap draft model for free.

Draft & Verify (Zhang et al. 2024, arXiv:2309.08168) drafts with the target itself, skipping a chosen set of
attention and MLP sub-layers, and verifies with all of them. This runner calls the HF model's own modules
in order (embeddings, each decoder layer's two residual sub-blocks, final norm, LM head), leaving out the
skipped sub-blocks; no model code is copied. It has its own KV cache: a layer whose attention is skipped
never writes to it, and its cache layer stays empty. Decoders whose layout is described (models/layouts.py).
"""

from __future__ import annotations

import torch

from accelgen.models.layouts import Decoder
from accelgen.models.runner import ModelRunner, additive_mask


class LayerSkipRunner(ModelRunner):
    def __init__(self, model, skip_attention: list[int], skip_mlp: list[int]):
        super().__init__(model)
        self.decoder = Decoder(model, "layer skipping")
        layers = self.decoder.layers
        self.skip_attention = check_layers("skip_attention", skip_attention, len(layers))
        self.skip_mlp = check_layers("skip_mlp", skip_mlp, len(layers))
        if len(self.skip_attention) == len(layers):
            raise ValueError("skip_attention skips every attention layer: the draft would not see the context")

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, tree: torch.Tensor | None = None, logits_for_last: int = 0) -> torch.Tensor:
        """As ModelRunner.forward, through the sub-layers that are not skipped."""
        start, m = self.length, token_ids.shape[0]
        if tree is None:
            tree = torch.ones(m, m, dtype=torch.bool).tril()
        positions = (start + tree.sum(dim=-1) - 1)[None].to(self.device)
        mask = additive_mask(start, tree, self.dtype, self.device)
        hidden = self.decoder.embed(token_ids, positions)
        walk = self.decoder.walk_inputs(hidden, positions)
        for index, layer in enumerate(self.decoder.layers):
            hidden = self.decoder.layer(layer, hidden, attend=index not in self.skip_attention,
                                        feed=index not in self.skip_mlp, mask=mask, cache=self.cache, **walk)
        if logits_for_last:
            hidden = hidden[:, -logits_for_last:]
        return self.decoder.logits(hidden)[0]


def check_layers(name: str, layers, count: int) -> frozenset[int]:
    try:
        chosen = frozenset(int(index) for index in layers)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of layer indices, got {layers!r}") from None
    outside = sorted(index for index in chosen if not 0 <= index < count)
    if outside:
        raise ValueError(f"{name}: the model has layers 0..{count - 1}, not {outside}")
    return chosen
