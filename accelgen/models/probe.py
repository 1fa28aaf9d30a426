"""`weights="auto"`: choose the weight format by measuring this machine, not by a rule.

Which format decodes fastest depends on the CPU far more than on the model: with native bf16 matrix units
bf16 is fast and verification nearly free; on an AVX2-only CPU bf16 is converted on the fly, the packed
int8/int4 kernels read less, and llama.cpp's quantized kernels on the GGUF file may beat them all. So each
candidate format is loaded and timed on the real model: one forward over 1 token and one over 8 tokens after a
short cache, t(1) and t(8), the costs of a decoding step and of a verification step.

The choice is the format with the most expected tokens per second:

    plain decoding                                  1 / t(1)
    a method whose 8-token verification yields a    max(1 / t(1), a / t(8))   (drafting cost aside, as for
    tokens on average (tokens_per_verify=a)                                    model-free drafters; the measured
                                                                               draft budget falls back to plain
                                                                               decoding when a / t(8) is less)

On a GPU nothing is probed: the candidates other than bf16 are CPU formats (llama.cpp's engine is CPU-only and
the packed int8/int4 kernels are CPU kernels first), and a GPU's matrix units are built for bf16, so
`device_choice` says bf16.

The timings are cached per machine (`accelgen.hardware.machine_key`: CPU, speed flags, threads, torch version)
and model under `weights-probe/` in the cache folder, so the probe runs once; the choice is made from them on
each call, and `probe_report` says what was chosen and why (`accelgen models`, `accelgen profile`).
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Callable

from accelgen import hardware
from accelgen.atomic import write_atomically
from accelgen.errors import InputError
from accelgen.models.checkpoints import cache_dir, load_format
from accelgen.models.embedded import EMBEDDED_MODELS

CANDIDATES = ("gguf", "int4", "int8", "bf16", "fp32")
PROBE_CONTEXT = 64  # tokens in the cache the timed forwards run after
PROBE_REPEATS = 3  # timed forwards per size (median), after one warm-up


def available_candidates(name_or_path: str) -> list[str]:
    """The formats this model can be loaded in here: the GGUF engine only for a GGUF file with xllamacpp installed."""
    candidates = [fmt for fmt in CANDIDATES if fmt != "gguf"]
    has_gguf = name_or_path in EMBEDDED_MODELS or str(name_or_path).endswith(".gguf")
    try:
        import xllamacpp  # noqa: F401
    except ImportError:
        has_gguf = False
    return (["gguf"] if has_gguf else []) + candidates


def measure_format(name_or_path: str, weights: str, threads: int | None = None) -> dict:
    """Load the model in `weights` and time one forward over 1 and over 8 tokens after PROBE_CONTEXT tokens:
    {"t1", "t8"} in seconds, and the seconds the load and the timing took."""
    import torch

    from accelgen.models.timing import batch_forward_seconds, timing_prompt

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        started = time.perf_counter()
        model, _ = load_format(name_or_path, weights, threads=threads)
        loaded = time.perf_counter()
        seconds = batch_forward_seconds(model, timing_prompt(model, PROBE_CONTEXT), 1, [1, 8], PROBE_REPEATS)
        timed = time.perf_counter()
    finally:
        torch.set_num_threads(previous)
        model = None
        gc.collect()  # one format's model is gone before the next one loads
    return {"t1": seconds[1], "t8": seconds[8], "load_seconds": loaded - started, "probe_seconds": timed - loaded}


def expected_tokens_per_second(timing: dict, tokens_per_verify: float | None = None) -> float:
    """Plain decoding: 1 / t(1); with tokens_per_verify = a, the better of that and a / t(8)."""
    plain = 1 / timing["t1"]
    return plain if tokens_per_verify is None else max(plain, tokens_per_verify / timing["t8"])


def decide(timings: dict[str, dict], tokens_per_verify: float | None = None) -> dict:
    """{"weights", "reason", "formula"}: the format with the most expected tokens/s, with the table in words."""
    speed = {fmt: expected_tokens_per_second(timing, tokens_per_verify) for fmt, timing in timings.items()}
    best = max(speed, key=speed.get)
    formula = "1 / t(1)" if tokens_per_verify is None else f"max(1 / t(1), {tokens_per_verify:g} / t(8))"
    table = ", ".join(f"{fmt} {speed[fmt]:.1f} tok/s (t(1) {t['t1'] * 1000:.0f} ms, t(8) {t['t8'] * 1000:.0f} ms)"
                      for fmt, t in sorted(timings.items(), key=lambda item: -speed[item[0]]))
    return {"weights": best, "formula": formula,
            "reason": f"most tokens/s by {formula} on this machine: {table}"}


def device_choice(device) -> dict:
    """What weights="auto" picks on a GPU, without measuring: {"weights": "bf16", "reason", "formula", "timings"}
    in the shape of choose_weights' answer (no timings)."""
    return {"weights": "bf16", "formula": None, "timings": {},
            "reason": f"on {device} weights=auto is bf16 without a probe: the probe times CPU formats, and llama.cpp "
                      "runs on the CPU only"}


def model_key(name_or_path: str) -> str:
    """A file name for the model: its own name (embedded, hub id) with a hash of the full path or id."""
    name = Path(str(name_or_path)).name or "model"
    return f"{name}-{hashlib.sha1(str(name_or_path).encode()).hexdigest()[:8]}"


def probe_path(name_or_path: str, threads: int | None = None) -> Path:
    return cache_dir() / "weights-probe" / hardware.machine_key(threads) / f"{model_key(name_or_path)}.json"


def choose_weights(name_or_path: str, threads: int | None = None, remeasure: bool = False,
                   measure: Callable[[str, str, int | None], dict] = measure_format,
                   candidates: list[str] | None = None, tokens_per_verify: float | None = None) -> dict:
    """{"weights", "reason", "formula", "timings", "machine", "model"}: the format with the most expected tokens/s
    for this model here (module docstring), from timings measured once and cached per machine and model
    (remeasure=True measures again). `measure(name, fmt, threads)` -> {"t1", "t8", ...} times one format:
    tests pass fake timings here."""
    path = probe_path(name_or_path, threads)
    if path.is_file() and not remeasure:
        probed = json.loads(path.read_text())
    else:
        probed = {"model": str(name_or_path), "machine": hardware.describe(threads),
                  "timings": measure_all(name_or_path, threads, measure, candidates)}
        write_atomically(path, lambda partial: partial.write_text(json.dumps(probed, indent=1) + "\n"))
    return {**probed, **decide(probed["timings"], tokens_per_verify)}


def measure_all(name_or_path: str, threads: int | None, measure: Callable, candidates: list[str] | None) -> dict:
    timings = {}
    for fmt in candidates or available_candidates(name_or_path):
        print(f"accelgen: probing weights={fmt} for {name_or_path} (once per machine)", file=sys.stderr)
        try:
            timings[fmt] = measure(name_or_path, fmt, threads)
        except (ValueError, RuntimeError, ImportError) as error:  # a format this model or machine cannot run
            print(f"accelgen: weights={fmt} unavailable: {error}", file=sys.stderr)
            continue
        timing = timings[fmt]
        print(f"accelgen: weights={fmt}: t(1) {timing['t1'] * 1000:.0f} ms, t(8) {timing['t8'] * 1000:.0f} ms",
              file=sys.stderr)
    if not timings:
        raise InputError(f"no weight format could be loaded for {name_or_path!r}")
    return timings


def cached_choice(name_or_path: str, threads: int | None = None, tokens_per_verify: float | None = None) -> dict | None:
    """What weights="auto" picks for this model on this machine, if the probe has run (else None): the same
    dict as choose_weights, without measuring."""
    path = probe_path(name_or_path, threads)
    if not path.is_file():
        return None
    probed = json.loads(path.read_text())
    return {**probed, **decide(probed["timings"], tokens_per_verify)}


def probe_report(name_or_path: str, threads: int | None = None) -> str | None:
    """One line for `accelgen models` / `accelgen profile`: what auto picks here and why (None before a probe)."""
    choice = cached_choice(name_or_path, threads)
    if choice is None:
        return None
    return (f"{name_or_path}: weights=auto picks {choice['weights']} on this machine "
            f"({hardware.flags_text(choice['machine'])}): {choice['reason']}")
