"""Which runner a model decodes with: its own engine's (llama.cpp), the static-cache runner with CUDA graphs on a
GPU (models/static.py), or the dynamic-cache ModelRunner (models/runner.py)."""

from __future__ import annotations

import torch

from accelgen.errors import InputError
from accelgen.models.llamacpp import LlamaCppModel
from accelgen.models.runner import ModelRunner
from accelgen.models.static import StaticRunner, static_cache_refusal

# "auto": static cache and CUDA graphs on a GPU where the model allows (the dynamic cache elsewhere); "static": the
# static cache anywhere (CUDA graphs on a GPU); "dynamic": a growing cache, every forward eager
CACHES = ("auto", "static", "dynamic")


def runner_for(model, cache: str = "auto", compile: bool | str = "auto"):
    """A fresh runner over a model (a transformers model, or a GGUF file loaded by llama.cpp), its cache as
    `cache` (one of CACHES) says. compile: the static runner's bucketed forwards through torch.compile, "auto" on
    CUDA (models/static.py); True asks for the static cache where `cache` is "auto"."""
    if cache not in CACHES:
        raise InputError(f"unknown cache {cache!r}; choose one of {', '.join(CACHES)}")
    if compile is True and cache == "dynamic":
        raise InputError("compile=True compiles the static cache's forwards; cache='dynamic' runs them eagerly")
    if isinstance(model, LlamaCppModel):
        if cache == "static":
            raise InputError("cache='static' is for PyTorch models; llama.cpp keeps its own cache")
        if compile is True:
            raise InputError("compile=True is for PyTorch models; llama.cpp runs its own kernels")
        return model.new_runner()
    if cache == "static" or compile is True or cache == "auto" and on_cuda(model) and static_cache_refusal(model) is None:
        return StaticRunner(model, compile=compile)
    return ModelRunner(model)


def on_cuda(model) -> bool:
    return isinstance(model, torch.nn.Module) and model.device.type == "cuda"
