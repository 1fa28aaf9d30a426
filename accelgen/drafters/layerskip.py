"""LayerSkip self-speculative decoding (Elhoushi et al. 2024, arXiv:2404.16710).

The target drafts with its first layers only, leaving after `exit_layer` through its own final norm and LM
head (an early exit), and verifies with all of them. It is the layer-skipping draft of `self-speculative`
with the skipped set fixed to every layer above the exit (models/layer_skip.py), so its output is exactly the
target's, greedy or sampled. LayerSkip's training (layer dropout rising with depth plus an early-exit loss)
is what makes an early exit accurate enough to pay; on a model not trained that way the drafts are accepted
less often, and the benchmark shows it. Not built: the paper's reuse of the draft's KV for the first layers
during verification (the verifying forward recomputes them).
"""

from __future__ import annotations

from accelgen.drafters.self_speculative import _make as make_self_speculative
from accelgen.registry import MethodSpec, register


def _make(target_model, *, exit_layer, **options):
    layer_count = target_model.config.num_hidden_layers
    exit_layer = layer_count // 2 - 1 if exit_layer is None else exit_layer
    if not 0 <= exit_layer < layer_count - 1:
        raise ValueError(f"layerskip: exit_layer must be a layer below the last (0..{layer_count - 2}), got {exit_layer}")
    upper = list(range(exit_layer + 1, layer_count))
    return make_self_speculative(target_model, skip={"skip_attention": upper, "skip_mlp": upper}, **options)


register(
    MethodSpec(
        name="layerskip",
        family="speculative",
        lossless="distribution-exact",
        paper="Elhoushi et al. 2024, arXiv:2404.16710",
        summary="the target drafts with its first layers and an early exit through its own LM head, then "
                "verifies with all layers",
        make_drafter=_make,
        options={"exit_layer": None, "gamma": 4, "gamma_schedule": "constant", "max_gamma": 32},
    )
)
