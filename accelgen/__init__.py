"""accelgen: faster generation for Hugging Face causal LMs, with proof that the output is unchanged."""

from accelgen.generate import Chunk, GenerationResult, GenerationStream, generate
from accelgen.models import EMBEDDED_MODELS, load_model
from accelgen.models.probe import choose_weights
from accelgen.registry import MethodSpec, get_method, list_methods, register

__version__ = "0.1.0"
__all__ = [
    "Chunk",
    "EMBEDDED_MODELS",
    "GenerationResult",
    "GenerationStream",
    "MethodSpec",
    "choose_weights",
    "generate",
    "get_method",
    "list_methods",
    "load_model",
    "register",
]
