"""LayerSkip self-speculative decoding (Elhoushi et al. 2024, arXiv:2404.16710).

The target drafts with its first layers only, leaving after `exit_layer` through its own final norm and LM
head (an early exit), and verifies with all of them, so its output is exactly the target's, greedy or sampled.
Draft and verification share one KV cache (models/exit_draft.py): the verifying forward starts the tokens the
draft fed above the exit, reusing their lower layers' keys, values and exit hidden states ("cache reuse").
LayerSkip's training (`accelgen train layerskip`: layer dropout rising with depth plus an early-exit loss)
is what makes an early exit accurate enough to pay; on a model not trained that way the drafts are accepted
less often, and the benchmark shows it.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelgen.drafters.base import BuildContext
from accelgen.drafters.draft_model import SelfDraftingOptions, make_self_drafter
from accelgen.models.exit_draft import ExitDraftRunner
from accelgen.registry import MethodOptions, MethodSpec, Part, register


def exit_layer_of(model, exit_layer: int | None) -> int:
    layer_count = model.config.num_hidden_layers
    exit_layer = layer_count // 2 - 1 if exit_layer is None else exit_layer
    if not 0 <= exit_layer < layer_count - 1:
        raise ValueError(f"layerskip: exit_layer must be a layer below the last (0..{layer_count - 2}), got {exit_layer}")
    return exit_layer


@dataclass(frozen=True)
class ExitLayerOptions(MethodOptions):
    exit_layer: int | None = None  # the draft's exit (None: the middle layer)


def _make_runner(model, options: ExitLayerOptions) -> ExitDraftRunner:
    return ExitDraftRunner(model, exit_layer_of(model, options.exit_layer))


def _make(build: BuildContext, options: SelfDraftingOptions):
    """Draft-model drafting whose draft model is the target runner's own first layers."""
    return make_self_drafter(build.target.draft, build, options)


register(
    MethodSpec(
        name="layerskip",
        family="speculative",
        lossless="distribution-exact",
        paper="Elhoushi et al. 2024, arXiv:2404.16710",
        summary="the target drafts with its first layers and an early exit through its own LM head, then "
                "verifies with the remaining layers, reusing the draft's cache",
        drafter=Part(_make, SelfDraftingOptions),
        runner=Part(_make_runner, ExitLayerOptions),
    )
)
