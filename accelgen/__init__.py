"""accelgen: faster generation for Hugging Face causal LMs, with proof that the output is unchanged."""

import importlib.metadata

from accelgen import hf
from accelgen.loop import Chunk, GenerationResult, GenerationStream, TokenLogprob, generate
from accelgen.models import EMBEDDED_MODELS, load_model
from accelgen.models.probe import choose_weights
from accelgen.registry import MethodSpec, declare_method, get_method, list_methods, register

# online speculative decoding's drafter trains the draft, so its module sits with the trainers, above the methods
# that the built-in table (accelgen/method_table.py) may name: declared here, it is still imported only when asked for
declare_method("online", "accelgen.train.online")

__version__ = importlib.metadata.version("accelgen")  # pyproject.toml is the one place it is written
__all__ = [
    "Chunk",
    "EMBEDDED_MODELS",
    "GenerationResult",
    "GenerationStream",
    "MethodSpec",
    "TokenLogprob",
    "choose_weights",
    "declare_method",
    "generate",
    "get_method",
    "hf",
    "list_methods",
    "load_model",
    "register",
]
