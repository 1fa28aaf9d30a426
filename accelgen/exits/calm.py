"""CALM: confident adaptive language modeling (Schuster et al. 2022, arXiv:2207.07061).

A decoded token leaves the layer stack at the first allowed exit layer where its confidence passes a threshold;
its exited hidden state is copied up to fill the skipped layers' KV (`models/early_exit.py`). CALM's three
confidence measures:

- `softmax`: softmax response, the gap between the top two probabilities of the exit head's prediction. Each
  check costs one LM-head matmul, which on these models is several layers' work (Qwen2.5-1.5B: 152k × 1536,
  about 5 layers; SmolLM2: about 8), hence few allowed exit layers;
- `saturation`: hidden-state saturation, the cosine similarity between a layer's output and its input: free;
- `classifier`: a trained early-exit classifier's probability that the exit agrees with the full model, one
  dot product per check; it comes with trained exit heads (`heads=FOLDER` from `accelgen train exit-heads`),
  whose adapters also sharpen the exits' predictions with any measure.

The threshold decides the trade: 1.0 never exits (the full model's output), lower values exit earlier. CALM
chooses it with Learn-then-Test so that agreement with the full model is guaranteed with high probability on
the calibration distribution: `accelgen calibrate calm` (accelgen/train/calibrate.py), then
`threshold="calibrated"` uses the saved result. CALM's decaying threshold is not built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from accelgen.drafters.autoregressive import no_drafter
from accelgen.errors import InputError
from accelgen.heads.exit_heads import ExitHeads
from accelgen.models.early_exit import EarlyExitRunner
from accelgen.models.loading import beside_weights
from accelgen.registry import MethodOptions, MethodSpec, Part, register

CALIBRATION_FILE = "calm.json"


def softmax_response(logits: torch.Tensor) -> float:
    """Top-1 minus top-2 probability of logits (vocab,): 1.0 for a certain prediction, 0.0 for a tie."""
    top = torch.softmax(logits.float(), dim=-1).topk(2).values
    return float(top[0] - top[1])


def saturation(previous: torch.Tensor, hidden: torch.Tensor) -> float:
    """Cosine similarity of a layer's input and output hidden states (d,), at most 1.0: the layer changed little."""
    return min(1.0, float(torch.nn.functional.cosine_similarity(previous.float(), hidden.float(), dim=0)))


MEASURES = ("softmax", "saturation", "classifier")


def default_exit_layers(layer_count: int) -> list[int]:
    """Exits allowed from the middle up, about every eighth of the depth: 30 layers -> 15, 18, 21, 24, 27."""
    return list(range(layer_count // 2, layer_count - 1, max(1, layer_count // 8)))


def check_exit_layers(exit_layers, layer_count: int) -> list[int]:
    if exit_layers is None:
        return default_exit_layers(layer_count)
    try:
        chosen = sorted({int(layer) for layer in exit_layers})
    except (TypeError, ValueError):
        raise InputError(f"exit_layers must be a list of layer indices, got {exit_layers!r}") from None
    outside = [layer for layer in chosen if not 0 <= layer < layer_count]
    if outside:
        raise InputError(f"exit_layers: the model has layers 0..{layer_count - 1}, not {outside}")
    return chosen


@dataclass(frozen=True)
class ConfidentExit:
    measure: str
    threshold: float
    exit_layers: frozenset[int]
    heads: ExitHeads | None = None  # trained classifiers, for measure="classifier"

    def first_layer(self, position: int) -> int:
        return 0

    def should_exit(self, token, layer, hidden, previous, logits) -> bool:
        if layer not in self.exit_layers:
            return False
        if self.measure == "softmax":
            confidence = softmax_response(logits())
        elif self.measure == "saturation":
            confidence = saturation(previous, hidden)
        else:
            confidence = float(self.heads.exit_confidence(layer, hidden))
        return confidence > self.threshold  # strictly: threshold 1.0 never exits


def calibrated_threshold(model, measure: str) -> float:
    path = beside_weights(model, CALIBRATION_FILE)  # written by `accelgen calibrate calm`
    saved = json.loads(path.read_text()) if path is not None and path.exists() else {}
    if measure not in saved:
        raise InputError(f"calm: no calibrated threshold for measure {measure!r} yet; run "
                         f"`accelgen calibrate calm --measure {measure}` first, or give threshold=<number>")
    return float(saved[measure]["threshold"])


def make_rule(model, *, measure: str, threshold, exit_layers, heads: ExitHeads | None = None) -> ConfidentExit:
    if measure not in MEASURES:
        raise InputError(f"calm: measure must be one of {', '.join(MEASURES)}, not {measure!r}")
    if threshold == "calibrated":
        threshold = calibrated_threshold(model, measure)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise InputError(f"calm: threshold must be a number in [0, 1] or 'calibrated', not {threshold!r}")
    if exit_layers is None and heads is not None:
        exit_layers = heads.layers  # where the heads were trained
    layers = check_exit_layers(exit_layers, model.config.num_hidden_layers)
    if measure == "classifier":
        if heads is None:
            raise InputError("calm: measure 'classifier' needs trained exit heads: heads=FOLDER "
                             "(from `accelgen train exit-heads`)")
        untrained = [layer for layer in layers if layer not in heads.layers]
        if untrained:
            raise InputError(f"calm: the exit heads have no classifier for layers {untrained} (trained: {heads.layers})")
    return ConfidentExit(measure, float(threshold), frozenset(layers), heads)


@dataclass(frozen=True)
class CalmOptions(MethodOptions):
    """The options of `calm` and `ee-recompute`."""

    measure: str = "softmax"  # one of MEASURES
    threshold: float | str = 0.9  # the confidence that exits, or "calibrated"
    exit_layers: list[int] | None = None  # the layers a token may exit at (None: default_exit_layers, or the heads')
    heads: str | None = None  # trained exit heads' folder, for measure "classifier"


def make_runner(model, *, heads, propagation: str = "copy", **rule) -> EarlyExitRunner:
    """The early-exit runner of `calm` (of `ee-recompute` with propagation="recompute", and of `consistent-ee`)."""
    heads = ExitHeads.load(heads, model) if heads else None
    return EarlyExitRunner(model, make_rule(model, heads=heads, **rule), propagation, heads=heads)


register(
    MethodSpec(
        name="calm",
        family="early-exit",
        lossless="lossy",
        paper="Schuster et al. 2022, arXiv:2207.07061",
        summary="each token leaves the layer stack once its confidence (softmax response, hidden-state saturation "
                "or a trained classifier) passes a threshold, calibrated by Learn-then-Test; skipped layers' KV "
                "from the copied state",
        drafter=Part(no_drafter),
        runner=Part(lambda model, options: make_runner(model, **options.as_dict()), CalmOptions),
    )
)
