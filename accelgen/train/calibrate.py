"""`accelgen calibrate calm`: choose CALM's threshold with Learn-then-Test (Angelopoulos et al. 2021,
arXiv:2110.01052), as CALM does, so that agreement with the full model is guaranteed, not hoped for.

The loss of one calibration prompt at threshold λ is its disagreement with the full model's greedy output,
1 − token agreement (accelgen.quality.token_agreement), in [0, 1]; the risk R(λ) is its expectation over
prompts like the calibration ones. For each λ the null hypothesis "R(λ) > ε" is tested with the
Hoeffding–Bentkus p-value of the mean loss over n prompts. Thresholds are tested from the safest (highest)
down, and testing stops at the first one whose null is not rejected at level δ (fixed-sequence testing: no
multiplicity correction needed). The lowest threshold rejected before that has, with probability at least 1 − δ
over the draw of calibration prompts, risk at most ε. If none is rejected, the answer is 1.0: never exit.
"""

from __future__ import annotations

import json
import math
from statistics import fmean
from typing import Callable

from scipy.stats import binom

from accelgen.atomic import write_json_atomically
from accelgen.errors import InputError
from accelgen.exits.calm import CALIBRATION_FILE
from accelgen.loop import generate
from accelgen.models.loading import beside_weights
from accelgen.quality import token_agreement


def hoeffding_bentkus_p_value(risk: float, n: int, epsilon: float) -> float:
    """p-value of the null "true risk > epsilon" given a mean loss `risk` in [0, 1] over n samples
    (Bates et al. 2021, Prop. 3.5): min(exp(−n·kl(min(risk, ε) ‖ ε)), e · P(Bin(n, ε) ≤ ⌈n·risk⌉))."""
    if not 0.0 < epsilon < 1.0:
        raise InputError(f"epsilon must be in (0, 1), got {epsilon}")
    low = min(risk, epsilon)
    kl = (low * math.log(low / epsilon) if low > 0 else 0.0) + (1 - low) * math.log((1 - low) / (1 - epsilon))
    hoeffding = math.exp(-n * kl)
    bentkus = math.e * float(binom.cdf(math.ceil(n * risk), n, epsilon))  # P(Bin(n, ε) ≤ ⌈n·risk⌉)
    return min(1.0, hoeffding, bentkus)


def learn_then_test(thresholds: list[float], risk_of: Callable[[float], float], n: int, epsilon: float,
                    delta: float) -> tuple[float | None, list[dict]]:
    """Test thresholds from the first (safest) on; risk_of(threshold) is the mean loss over n prompts, asked
    only as far as testing goes. Returns (the last threshold whose null was rejected, or None; what was tested)."""
    chosen, tested = None, []
    for threshold in thresholds:
        risk = risk_of(threshold)
        p_value = hoeffding_bentkus_p_value(risk, n, epsilon)
        tested.append({"threshold": threshold, "risk": risk, "p_value": p_value, "rejected": p_value <= delta})
        if p_value > delta:
            break
        chosen = threshold
    return chosen, tested


def calibrate_calm(model, tokenizer, prompts: list[list[int]], *, measure: str, thresholds: list[float],
                   epsilon: float, delta: float, max_new_tokens: int, exit_layers=None, heads=None,
                   progress: Callable[[dict], None] | None = None) -> dict:
    """Learn-then-Test over generations of the calibration prompts; returns the result `save_calibration` keeps."""
    if not prompts:
        raise InputError("calibration needs at least one prompt")
    thresholds = sorted(thresholds, reverse=True)
    references = [generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens, temperature=0.0).token_ids for prompt in prompts]

    def risk_of(threshold: float) -> float:
        losses, layers = [], []
        for prompt, reference in zip(prompts, references):
            result = generate(model, tokenizer, prompt, method="calm", max_new_tokens=max_new_tokens, temperature=0.0,
                              measure=measure, threshold=threshold, exit_layers=exit_layers, heads=heads)
            losses.append(1.0 - token_agreement(reference, result.token_ids))
            layers.append(result.stats["mean_layers"])
        if progress is not None:
            progress({"threshold": threshold, "risk": fmean(losses), "mean_layers": fmean(layers)})
        return fmean(losses)

    chosen, tested = learn_then_test(thresholds, risk_of, len(prompts), epsilon, delta)
    return {"measure": measure, "threshold": 1.0 if chosen is None else chosen, "epsilon": epsilon, "delta": delta,
            "prompts": len(prompts), "max_new_tokens": max_new_tokens, "exit_layers": exit_layers,
            "heads": None if heads is None else str(heads), "tested": tested}


def save_calibration(model, result: dict):
    """Keep the result beside the model's weights, one entry per measure; returns the path."""
    path = beside_weights(model, CALIBRATION_FILE, saving="the calibrated threshold")
    saved = json.loads(path.read_text()) if path.exists() else {}
    saved[result["measure"]] = result
    write_json_atomically(path, saved)
    return path
