"""accelgen: faster generation for Hugging Face causal LMs, with proof that the output is unchanged."""

import importlib.metadata

from accelgen import hf
from accelgen.generate import Chunk, GenerationResult, GenerationStream, TokenLogprob, generate
from accelgen.models import EMBEDDED_MODELS, load_model
from accelgen.models.probe import choose_weights
from accelgen.registry import MethodSpec, get_method, list_methods, register

__version__ = importlib.metadata.version("accelgen")  # pyproject.toml is the one place it is written
__all__ = [
    "Chunk",
    "EMBEDDED_MODELS",
    "GenerationResult",
    "GenerationStream",
    "MethodSpec",
    "TokenLogprob",
    "choose_weights",
    "generate",
    "get_method",
    "hf",
    "list_methods",
    "load_model",
    "register",
]
