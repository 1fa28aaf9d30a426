"""FREE: fast and robust early exiting (Bae et al. 2023, arXiv:2310.05424).

A shallow-deep module: one exit, after `exit_layer` (the shallow model), else the full depth (the deep model).
A token whose top-1 probability at the exit beats the threshold leaves there. Its deep layers are not copied
(CALM) but wait: when a later token goes deep, the waiting tokens' upper layers run beside it as extra rows
of the same forward, *synchronized parallel decoding* (`models/early_exit.py`, propagation="synchronized").
So the cache ends up exactly the full model's, and on memory-bound hardware the extra rows cost little.

Those deep passes show, for tokens that exited, what the full model would have predicted, and tokens that went
deep show it for confidences below the threshold. FREE uses these pairs to set the threshold itself: the
confidences of predictions that agreed with the deep model and of those that did not are each fitted with a
Beta distribution (method of moments), and the threshold becomes the lowest confidence from which the
posterior probability of agreement stays at least `agreement` (`threshold="adaptive"`, from 0.9 until both
kinds have been seen a few times). Here the estimate lives for one generation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from accelgen.drafters.autoregressive import no_drafter
from accelgen.errors import InputError
from accelgen.models.early_exit import EarlyExitRunner
from accelgen.registry import MethodOptions, MethodSpec, Part, register

INITIAL_THRESHOLD = 0.9
MIN_SAMPLES = 8  # of each kind, agreeing and disagreeing, before the fitted threshold replaces the initial one
EDGE = 1e-4  # confidences are kept inside (0, 1), where the Beta density is finite


def top_probability(logits: torch.Tensor) -> float:
    """FREE's confidence: the largest softmax probability of logits (vocab,)."""
    return float(torch.softmax(logits.float(), dim=-1).max())


def fit_beta(samples: list[float]) -> tuple[float, float]:
    """(a, b) of the Beta distribution with the samples' mean and variance (method of moments)."""
    values = [min(max(x, EDGE), 1 - EDGE) for x in samples]
    mean = sum(values) / len(values)
    variance = max(sum((x - mean) ** 2 for x in values) / len(values), 1e-6)
    common = max(mean * (1 - mean) / variance - 1, 1e-3)
    return mean * common, (1 - mean) * common


def beta_log_density(x: float, a: float, b: float) -> float:
    x = min(max(x, EDGE), 1 - EDGE)
    return (a - 1) * math.log(x) + (b - 1) * math.log(1 - x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))


def agreement_posterior(confidence: float, agreeing: tuple[float, float], disagreeing: tuple[float, float],
                        prior: float) -> float:
    """P(the exit agrees with the deep model | its confidence) under the two-component Beta mixture."""
    agree = math.log(prior) + beta_log_density(confidence, *agreeing)
    disagree = math.log(1 - prior) + beta_log_density(confidence, *disagreeing)
    return 1 / (1 + math.exp(min(disagree - agree, 700)))


def adaptive_threshold(agreeing: list[float], disagreeing: list[float], agreement: float, steps: int = 100) -> float:
    """The lowest confidence on a grid of `steps` from which the posterior of agreement stays >= agreement
    (1.0: never exit, if even the most confident exits are not trusted that much)."""
    fits = fit_beta(agreeing), fit_beta(disagreeing)
    prior = len(agreeing) / (len(agreeing) + len(disagreeing))
    threshold = 1.0
    for step in range(steps - 1, -1, -1):
        confidence = step / steps
        if agreement_posterior(confidence, *fits, prior) < agreement:
            break
        threshold = confidence
    return threshold


@dataclass
class ShallowDeepExit:
    exit_layer: int
    agreement: float
    fixed_threshold: float | None  # None: adaptive
    agreeing: list[float] = field(default_factory=list)  # confidences of exit predictions the deep model confirmed
    disagreeing: list[float] = field(default_factory=list)
    threshold: float = INITIAL_THRESHOLD

    def __post_init__(self):
        if self.fixed_threshold is not None:
            self.threshold = self.fixed_threshold

    def first_layer(self, position: int) -> int:
        return 0

    def should_exit(self, token, layer, hidden, previous, logits) -> bool:
        return layer == self.exit_layer and top_probability(logits()) > self.threshold

    def observe(self, layer: int, shallow: torch.Tensor, deep: torch.Tensor) -> None:
        """Exit predictions (k, vocab) at `layer` beside the deep model's (k, vocab): refit the threshold."""
        if layer != self.exit_layer:
            return
        for shallow_row, deep_row in zip(shallow, deep):
            agreed = int(shallow_row.argmax()) == int(deep_row.argmax())
            (self.agreeing if agreed else self.disagreeing).append(top_probability(shallow_row))
        if self.fixed_threshold is None and min(len(self.agreeing), len(self.disagreeing)) >= MIN_SAMPLES:
            self.threshold = adaptive_threshold(self.agreeing, self.disagreeing, self.agreement)


@dataclass(frozen=True)
class FreeOptions(MethodOptions):
    exit_layer: int | None = None  # the shallow exit (None: the middle layer)
    threshold: float | str = "adaptive"  # the confidence that exits, or "adaptive": fitted as it decodes
    agreement: float = 0.9  # how often the exit must agree with the deep model, for the adaptive threshold


def make_rule(model, *, exit_layer, threshold, agreement) -> ShallowDeepExit:
    layer_count = model.config.num_hidden_layers
    exit_layer = layer_count // 2 - 1 if exit_layer is None else exit_layer
    if not 0 <= exit_layer < layer_count - 1:
        raise InputError(f"free: exit_layer must be a layer below the last (0..{layer_count - 2}), got {exit_layer}")
    if threshold != "adaptive" and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                    or not 0.0 <= threshold <= 1.0):
        raise InputError(f"free: threshold must be 'adaptive' or a number in [0, 1], not {threshold!r}")
    if not 0.0 < agreement < 1.0:
        raise InputError(f"free: agreement must be in (0, 1), got {agreement}")
    return ShallowDeepExit(exit_layer, agreement, None if threshold == "adaptive" else float(threshold))


register(
    MethodSpec(
        name="free",
        family="early-exit",
        lossless="lossy",
        paper="Bae et al. 2023, arXiv:2310.05424",
        summary="one shallow exit or the full depth; exited tokens' deep layers run beside the next deep token "
                "(synchronized parallel decoding); threshold fitted with a Beta mixture as it decodes",
        drafter=Part(no_drafter),
        runner=Part(lambda model, options: EarlyExitRunner(model, make_rule(model, **options.as_dict()),
                                                            propagation="synchronized"), FreeOptions),
    )
)
