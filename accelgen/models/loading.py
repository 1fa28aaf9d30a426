"""Load a causal LM and its tokenizer: an embedded default, a HF model id, a local folder or a .gguf file, in a
weight format given or, with weights="auto", chosen by measuring this machine.

The top of models/'s loading side: `load_model` resolves "auto" by the probe (models/probe.py), which loads and
times each candidate format through models/checkpoints.py, and then reads the checkpoint from there. The names
of models/checkpoints.py are importable from here too, as they were before the two were split.
"""

from __future__ import annotations

import sys

import torch

from accelgen.models import probe
from accelgen.models.checkpoints import (
    CACHE_DTYPE, DEVICE_CHOICES, DEVICE_HELP, DRAFT_WEIGHTS_HELP, DTYPES, EMBEDDED_MODELS, QUANTIZED, WEIGHTS,
    WEIGHTS_HELP, beside_weights, cache_dir, cached_model_dir, check_source, check_weights, gguf_file, is_cached,
    load_format, load_llamacpp, local_folder, prepare_embedded, prepare_gguf, quantize_cached, quantized_cache_path,
    require_gguf_extra, resolve_device, resolve_dtype, save_quantized, write_atomically,
)

# load_model, and models/checkpoints.py's names, importable from here as before the two were split
__all__ = [
    "CACHE_DTYPE", "DEVICE_CHOICES", "DEVICE_HELP", "DRAFT_WEIGHTS_HELP", "DTYPES", "EMBEDDED_MODELS", "QUANTIZED",
    "WEIGHTS", "WEIGHTS_HELP", "beside_weights", "cache_dir", "cached_model_dir", "check_source", "check_weights",
    "chosen_weights", "gguf_file", "is_cached", "load_format", "load_llamacpp", "load_model", "local_folder",
    "prepare_embedded", "prepare_gguf", "quantize_cached", "quantized_cache_path", "require_gguf_extra",
    "resolve_device", "resolve_dtype", "save_quantized", "write_atomically", "default_weights", "pytorch_weights",
]


def load_model(
    name_or_path: str,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    attn_implementation: str = "sdpa",
    weights: str | None = None,
    threads: int | None = None,
):
    """Return (model, tokenizer) for an embedded name, a HF id, a local folder or a .gguf file.

    device: "cpu" (None: the default), "cuda", "cuda:N", "auto" (CUDA when torch sees a device, else the CPU) or a
    torch.device; the model is moved there and `model.device` says so.
    weights: None (dtype decides), "fp32" or "bf16" (dense, in that dtype whatever `dtype` says), "int8" or
    "int4" (weight-only quantized linear layers, accelgen/models/formats.py; the rest of the model runs in `dtype`,
    bfloat16 by default, and the quantized tensors are cached so that later loads take seconds), "gguf" (the
    GGUF file itself, run by llama.cpp on the CPU: accelgen/models/llamacpp.py), or "auto": the format a short
    probe of this machine found fastest (accelgen/models/probe.py, measured once per machine and model); on a GPU
    "auto" is bf16, as the probe times CPU formats.
    Without weights or dtype, an embedded model on the CPU runs in its fastest format (`default_weights`: what
    weights="auto" measured here, else its GGUF file as shipped), said on stderr with the reason. Otherwise, without
    weights, dtype defaults to bfloat16 for embedded models and on a GPU, and to the checkpoint's own dtype.
    """
    check_weights(weights)
    check_source(name_or_path)
    target = resolve_device(device)
    if weights is None and dtype is None:
        weights = default_weights(name_or_path, target, threads)
    if weights == "auto":
        weights = chosen_weights(name_or_path, target, threads)
    return load_format(name_or_path, weights, dtype, target, attn_implementation, threads)


def default_weights(name_or_path: str, target: torch.device, threads: int | None) -> str | None:
    """The format of a load that names none (neither weights nor dtype): for an embedded model on the CPU, what
    weights="auto" measured fastest on this machine if its probe has run, else the GGUF file as shipped (llama.cpp's
    4-bit kernels decode it about 3x faster than dense bf16), else bf16 where llama.cpp is not installed; said on
    stderr with the reason. Other models, and any model on a GPU: None (the checkpoint's dtype; bf16 on a GPU)."""
    if name_or_path not in EMBEDDED_MODELS or target.type != "cpu":
        return None
    measured = probe.cached_choice(name_or_path, threads)
    if measured is not None:
        weights, why = measured["weights"], f"the fastest format measured on this machine ({measured['reason']})"
    elif "gguf" in probe.available_candidates(name_or_path):
        weights, why = "gguf", ("its GGUF file as shipped, run by llama.cpp (--weights auto measures every format "
                                "once on this machine and picks the fastest)")
    else:
        weights, why = "bf16", "llama.cpp is not installed (pip install 'accelgen[llamacpp]' runs the GGUF file)"
    print(f"accelgen: {name_or_path} loads as weights={weights}: {why}; pass --weights (weights=) to choose",
          file=sys.stderr)
    return weights


def pytorch_weights(name_or_path: str, weights: str | None, dtype=None) -> str | None:
    """weights for a load that needs a PyTorch model (training, reading hidden states, walking layers): as given;
    else, with no dtype either, bf16 for an embedded model (whose default would be its GGUF file); else None (dtype
    decides, or the checkpoint's own)."""
    return "bf16" if weights is None and dtype is None and name_or_path in EMBEDDED_MODELS else weights


def chosen_weights(name_or_path: str, target: torch.device, threads: int | None) -> str:
    """What weights="auto" loads on target: bf16 on a GPU without a probe, else the probe's choice here."""
    if target.type != "cpu":
        weights = probe.device_choice(target)["weights"]
        print(f"accelgen: weights=auto on {target}: {weights}, without timing the CPU formats (the probe and llama.cpp "
              "run on the CPU only)", file=sys.stderr)
        return weights
    choice = probe.choose_weights(name_or_path, threads=threads)
    print(f"accelgen: weights=auto for {name_or_path}: {choice['weights']}, the {choice['reason']}", file=sys.stderr)
    return choice["weights"]
