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

from accelgen.costs import SELF_DRAFT_COST
from accelgen.drafters.draft_model import DraftModelDrafter, scheduled
from accelgen.models.exit_draft import ExitDraftRunner
from accelgen.registry import MethodSpec, register


class LayerSkipDrafter(DraftModelDrafter):
    """Draft-model drafting whose draft model is the target runner's own first layers (set by `attach`)."""

    def attach(self, target: ExitDraftRunner) -> None:
        self.runner = target.draft


def exit_layer_of(model, exit_layer: int | None) -> int:
    layer_count = model.config.num_hidden_layers
    exit_layer = layer_count // 2 - 1 if exit_layer is None else exit_layer
    if not 0 <= exit_layer < layer_count - 1:
        raise ValueError(f"layerskip: exit_layer must be a layer below the last (0..{layer_count - 2}), got {exit_layer}")
    return exit_layer


def _make_runner(model, *, exit_layer, **_):
    return ExitDraftRunner(model, exit_layer_of(model, exit_layer))


def _make(target_model, *, sampling, generator, gamma, gamma_schedule, max_gamma, **_):
    drafter = LayerSkipDrafter(None, sampling, generator, gamma=gamma, gamma_schedule=gamma_schedule, max_gamma=max_gamma)
    return scheduled(drafter, target_model, cost_ratio=SELF_DRAFT_COST)


register(
    MethodSpec(
        name="layerskip",
        family="speculative",
        lossless="distribution-exact",
        paper="Elhoushi et al. 2024, arXiv:2404.16710",
        summary="the target drafts with its first layers and an early exit through its own LM head, then "
                "verifies with the remaining layers, reusing the draft's cache",
        make_drafter=_make,
        make_runner=_make_runner,
        options={"exit_layer": None, "gamma": 4, "gamma_schedule": "constant", "max_gamma": 32},
    )
)
