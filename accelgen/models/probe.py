"""`weights="auto"`: choose the weight format by measuring this machine, not by a rule.

Which format decodes fastest depends on the CPU far more than on the model: with native bf16 matrix units
bf16 is fast and verification nearly free; on an AVX2-only CPU bf16 is converted on the fly, the packed
int8/int4 kernels read less, and llama.cpp's quantized kernels on the GGUF file beat them all. So each candidate
format is loaded and timed: one forward over 1 token and one over 8 tokens after a short cache (the costs of
a decoding step and of a verification step). The format with the most tokens per second in plain decoding,
1 / t(1), is chosen; t(8) / t(1) is kept beside it, as it says how much room speculation has. The result is
cached per machine (`accelgen.hardware.machine_key`) and model, so the probe runs once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from accelgen import hardware
from accelgen.models.loading import cache_dir

CANDIDATES = ("gguf", "int4", "int8", "bf16", "fp32")
PROBE_CONTEXT = 64
PROBE_REPEATS = 3


def available_candidates(name_or_path: str) -> list[str]:
    """The formats this model can be loaded in here: the GGUF engine only for a GGUF file with xllamacpp installed."""
    from accelgen.models.loading import EMBEDDED_MODELS

    candidates = [fmt for fmt in CANDIDATES if fmt != "gguf"]
    has_gguf = name_or_path in EMBEDDED_MODELS or str(name_or_path).endswith(".gguf")
    try:
        import xllamacpp  # noqa: F401
    except ImportError:
        has_gguf = False
    return (["gguf"] if has_gguf else []) + candidates


def measure_format(name_or_path: str, weights: str, threads: int | None = None) -> dict:
    """Load the model in `weights` and time one forward over 1 and over 8 tokens after PROBE_CONTEXT tokens."""
    from accelgen.models.loading import load_model
    from accelgen.profile import batch_forward_seconds, timing_prompt

    model, _ = load_model(name_or_path, weights=weights, threads=threads)
    seconds = batch_forward_seconds(model, timing_prompt(model, PROBE_CONTEXT), 1, [1, 8], PROBE_REPEATS)
    return {"t1": seconds[1], "t8": seconds[8]}


def decide(timings: dict[str, dict]) -> dict:
    """The format with the most tokens/s in plain decoding (1 / t1), with the reason in words."""
    best = min(timings, key=lambda fmt: timings[fmt]["t1"])
    table = ", ".join(f"{fmt} {1 / t['t1']:.1f} tok/s (r(8) {t['t8'] / t['t1']:.1f})" for fmt, t in timings.items())
    return {"weights": best, "timings": timings,
            "reason": f"fastest one-token forward on this machine: {table}"}


def probe_path(name_or_path: str, threads: int | None) -> Path:
    model_key = Path(str(name_or_path)).name or str(name_or_path)
    return cache_dir() / "weights-probe" / hardware.machine_key(threads) / f"{model_key}.json"


def choose_weights(name_or_path: str, threads: int | None = None, remeasure: bool = False,
                   measure: Callable[[str, str, int | None], dict] = measure_format,
                   candidates: list[str] | None = None) -> dict:
    """{"weights", "timings", "reason", "machine"}: the fastest format for this model here, measured once and
    cached per machine and model (remeasure=True measures again)."""
    path = probe_path(name_or_path, threads)
    if path.is_file() and not remeasure:
        return json.loads(path.read_text())
    timings = {}
    for fmt in candidates or available_candidates(name_or_path):
        print(f"accelgen: probing weights={fmt} for {name_or_path} (once per machine)", file=sys.stderr)
        try:
            timings[fmt] = measure(name_or_path, fmt, threads)
        except (ValueError, RuntimeError) as error:  # a format this model or machine cannot run
            print(f"accelgen: weights={fmt} unavailable: {error}", file=sys.stderr)
    if not timings:
        raise ValueError(f"no weight format could be loaded for {name_or_path!r}")
    choice = {**decide(timings), "machine": hardware.describe(threads)}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(choice, indent=1) + "\n")
    partial.replace(path)
    return choice


def cached_choice(name_or_path: str, threads: int | None = None) -> dict | None:
    """The probe's saved choice for this model on this machine, if it has run."""
    path = probe_path(name_or_path, threads)
    return json.loads(path.read_text()) if path.is_file() else None
