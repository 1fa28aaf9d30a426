"""Self-speculative decoding, Draft & Verify (Zhang et al. 2024, arXiv:2309.08168).

The target drafts for itself with some attention and MLP sub-layers skipped, then verifies with all of them: no
second model, no training. The draft model is a second runner over the target with its own KV cache, walking the
layers as the plan `SkipSubBlocks` says (a layer whose attention is skipped never writes to that cache); the
HF model's own modules run in order, no model code is copied. Drafting is draft-model speculation with that
runner (draft_model.py), so γ schedules and sampling come with it.

Which layers to skip decides the speed: `accelgen tune self-speculative --model M` searches the skip sets
with Bayesian optimisation (tune.py) and saves the best next to the cached model; `skip="tuned"` (the
default) uses that file, or, before any tuning, skips the attention and MLP of every other layer of the
second half, a common starting point (a skip set changes speed only, never the output).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from accelgen.drafters.base import BuildContext
from accelgen.drafters.draft_model import SelfDraftingOptions, make_self_drafter
from accelgen.errors import InputError
from accelgen.models.runner import ModelRunner
from accelgen.models.loading import beside_weights
from accelgen.registry import MethodOptions, MethodSpec, Part, register

SKIP_FILE = "self-speculative.json"


class SkipSubBlocks:
    """A layer plan (models/runner.py: LayerPlan) that leaves out chosen attention and MLP sub-blocks."""

    purpose = "layer skipping"

    def __init__(self, model, skip_attention: list[int], skip_mlp: list[int]):
        count = model.config.num_hidden_layers
        self.skip_attention = check_layers("skip_attention", skip_attention, count)
        self.skip_mlp = check_layers("skip_mlp", skip_mlp, count)
        if len(self.skip_attention) == count:
            raise InputError("skip_attention skips every attention layer: the draft would not see the context")

    def sub_blocks(self, layer: int) -> tuple[bool, bool]:
        return layer not in self.skip_attention, layer not in self.skip_mlp


def skipping_runner(model, skip_attention: list[int], skip_mlp: list[int]) -> ModelRunner:
    """A runner of its own over the model (its own KV cache), with those sub-blocks left out."""
    return ModelRunner(model, SkipSubBlocks(model, skip_attention, skip_mlp))


def check_layers(name: str, layers, count: int) -> frozenset[int]:
    try:
        chosen = frozenset(int(index) for index in layers)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a list of layer indices, got {layers!r}") from None
    outside = sorted(index for index in chosen if not 0 <= index < count)
    if outside:
        raise InputError(f"{name}: the model has layers 0..{count - 1}, not {outside}")
    return chosen


def default_skip(layer_count: int) -> dict[str, list[int]]:
    """Every other layer of the second half: e.g. 30 layers -> 15, 17, ..., 29."""
    layers = list(range(layer_count // 2, layer_count, 2))
    return {"skip_attention": layers, "skip_mlp": layers}


def resolve_skip(model, skip) -> dict[str, list[int]]:
    """skip: "tuned" (saved by `accelgen tune`, else the default), "default", or {"skip_attention", "skip_mlp"}."""
    if isinstance(skip, dict):
        unknown = sorted(set(skip) - {"skip_attention", "skip_mlp"})
        if unknown:
            raise InputError(f"self-speculative: skip takes skip_attention and skip_mlp, not {', '.join(unknown)}")
        return {"skip_attention": list(skip.get("skip_attention", [])), "skip_mlp": list(skip.get("skip_mlp", []))}
    if skip == "tuned":
        path = beside_weights(model, SKIP_FILE)  # written by `accelgen tune`
        if path is not None and path.exists():
            return resolve_skip(model, json.loads(path.read_text())["skip"])
        skip = "default"
    if skip == "default":
        return default_skip(model.config.num_hidden_layers)
    raise InputError(f"self-speculative: skip must be 'tuned', 'default' or a dict of layer lists, got {skip!r}")


@dataclass(frozen=True)
class SkipOptions(MethodOptions):
    skip: str | dict = "tuned"  # the sub-layers skipped while drafting: see resolve_skip


@dataclass(frozen=True)
class SelfSpeculativeOptions(SelfDraftingOptions, SkipOptions):
    """skip, then the drafting options (a dataclass lists the fields of its last base first)."""


def _make(build: BuildContext, options: SelfSpeculativeOptions):
    runner = skipping_runner(build.target_model, **resolve_skip(build.target_model, options.skip))
    return make_self_drafter(runner, build, options)


register(
    MethodSpec(
        name="self-speculative",
        family="speculative",
        lossless="distribution-exact",
        paper="Zhang et al. 2024, arXiv:2309.08168",
        summary="the target drafts for itself with attention and MLP sub-layers skipped (skip set tuned by Bayesian "
                "optimisation: `accelgen tune`), then verifies with all layers",
        drafter=Part(_make, SelfSpeculativeOptions),
        draft_budget="measured",  # drafts capped by the measured costs unless the request fixes their length
    )
)
