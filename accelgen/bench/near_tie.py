"""What a near-tie is: the one definition that the benchmark's divergence audit (accelgen/bench/audit.py),
scripts/gpu_audit.py and the docs (docs/benchmark.md, "Identical output and the divergence audit") all use.

Two runs of the same greedy decoding may pick different tokens where the model's best logits are about as close
as the rounding: a (k+1)-token verification forward, a split prefill or another kernel sums in another order.
Such a difference is a *near-tie* when both tokens' logits are within TIE_ULPS units in the last place (ulps) of
the best logit, in the dtype the runs decoded in. bfloat16 keeps 8 significant bits (7 stored), so a logit in
[16, 32) is a multiple of 1/8 and 4 ulps is 0.5 (0.25 in [8, 16)); float16 keeps 11 bits (4 ulps at 16 is 1/16).
Each run rounds every layer's output on its own, so one or two ulps of disagreement in the final logits is
routine; four leaves room for that without excusing a token that is clearly worse. In float32 nothing is
excused: any difference is an error.

llama.cpp rounds by batch layout, not by a dtype: a one-token decode and a block decode differ by up to about one
logit on a 4-bit model, so there two tokens within LLAMACPP_TIE of the best are tied (docs/llamacpp-engine.md).
"""

from __future__ import annotations

import math

import torch

TIE_ULPS = 4
LLAMACPP_TIE = 1.0
SIGNIFICAND_BITS = {torch.bfloat16: 8, torch.float16: 11}  # including the implicit leading bit


def ulp(value: float, dtype: torch.dtype) -> float:
    """Spacing of representable numbers of dtype around value."""
    _, exponent = math.frexp(abs(value))  # abs(value) = mantissa * 2**exponent, mantissa in [0.5, 1)
    return 2.0 ** (exponent - SIGNIFICAND_BITS[dtype])


def tie_tolerance(dtype: torch.dtype | None, magnitude: float) -> float | None:
    """How far below the best logit (of this magnitude) a token may be and still count as tied: TIE_ULPS ulps in
    dtype; None where nothing is a tie (float32)."""
    if dtype not in SIGNIFICAND_BITS:
        return None
    return TIE_ULPS * ulp(magnitude, dtype)


def tie_gap(logits: torch.Tensor, token_a: int, token_b: int) -> float:
    """How far the worse of two tokens is below the best logit of logits (vocab,)."""
    logits = logits.float()
    return float(logits.max()) - min(float(logits[token_a]), float(logits[token_b]))


def is_near_tie(logits: torch.Tensor, token_a: int, token_b: int, dtype: torch.dtype | None,
                tolerance: float | None = None) -> bool:
    """Whether two runs that picked token_a and token_b after these reference logits (vocab,) merely rounded a
    near-tie differently: both tokens within TIE_ULPS ulps of the best logit in dtype, the dtype the runs decoded
    in (or within tolerance, for an engine whose rounding is not a dtype's: LLAMACPP_TIE). Never in float32."""
    if tolerance is None:
        tolerance = tie_tolerance(dtype, float(logits.float().max()))
    return tolerance is not None and tie_gap(logits, token_a, token_b) <= tolerance
