"""vLLM's serve options in accelgen's terms: `--speculative-config` as a method with its options and draft model,
`--allowed-origins`, `--chat-template`. Nothing here loads a model, so a bad option fails before one loads."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from accelgen.errors import InputError

# vLLM's speculative methods with no counterpart here -> why
NO_COUNTERPART = {
    "mtp": "it drafts with the model's own multi-token-prediction layers, which accelgen does not run",
    "deepseek_mtp": "it drafts with the model's own multi-token-prediction layers, which accelgen does not run",
    "ernie_mtp": "it drafts with the model's own multi-token-prediction layers, which accelgen does not run",
    "qwen3_next_mtp": "it drafts with the model's own multi-token-prediction layers, which accelgen does not run",
    "mlp_speculator": "accelgen has no MLP-speculator drafter",
}
HEAD_METHODS = {"eagle": "eagle", "eagle3": "eagle", "medusa": "medusa"}  # vLLM's -> accelgen's (heads=model)
# the keys translated; the others vLLM takes (tensor parallelism, quantization of the draft, ...) are refused
PLD_MAX_NGRAM = 3  # pld's default max_ngram (drafters/prompt_lookup.py)
KNOWN_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
# keys vLLM's documented examples carry, accepted at the one value that holds here
ONE_VALUE_KEYS = {"draft_tensor_parallel_size": 1}  # the draft runs on the target's one device


@dataclass
class Speculation:
    """What `--speculative-config` means here: the method, its options (as -o gives them) and the draft model."""

    method: str
    options: dict = field(default_factory=dict)
    draft: str | None = None


def speculative_config(text: str) -> Speculation:
    """vLLM's --speculative-config JSON as accelgen's method and options. Raises ValueError naming what has no
    counterpart (a method, a key) or is malformed."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(f"--speculative-config is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise InputError(f"--speculative-config must be a JSON object, got {type(config).__name__}")
    unknown = sorted(set(config) - KNOWN_KEYS - set(ONE_VALUE_KEYS))
    if unknown:
        raise InputError(f"--speculative-config: {', '.join(unknown)} has no counterpart in accelgen; it takes "
                         f"{', '.join(sorted(KNOWN_KEYS | set(ONE_VALUE_KEYS)))}")
    for name, value in ONE_VALUE_KEYS.items():
        if config.get(name, value) != value:
            raise InputError(f"--speculative-config {name} must be {value} here, got {config[name]!r}")
    method, model = config.get("method"), config.get("model")
    if method is None:  # vLLM's own rule: a model and no method is a draft model ("[ngram]" is the old spelling)
        method = "ngram" if model in ("[ngram]", "ngram") else "draft_model"
    if method in NO_COUNTERPART:
        raise InputError(f"--speculative-config method {method!r} has no counterpart in accelgen: "
                         f"{NO_COUNTERPART[method]}; use ngram, draft_model, eagle, eagle3 or medusa")
    tokens = config.get("num_speculative_tokens")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise InputError(f"--speculative-config num_speculative_tokens must be an integer >= 1, got {tokens!r}")
    lookup = {name: config[name] for name in ("prompt_lookup_max", "prompt_lookup_min") if name in config}
    if lookup and method != "ngram":
        raise InputError(f"--speculative-config: {', '.join(lookup)} belong to method ngram, not {method!r}")
    if method == "ngram":
        return ngram(tokens, lookup)
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise InputError("--speculative-config method draft_model needs \"model\": the draft model's path or id")
        return Speculation("speculative", {} if tokens is None else {"gamma": tokens}, draft=model)
    if method in HEAD_METHODS:
        if not isinstance(model, str) or not model:
            raise InputError(f"--speculative-config method {method!r} needs \"model\": the heads' folder")
        options = {"heads": model}
        if tokens is not None and HEAD_METHODS[method] == "eagle":  # medusa drafts as deep as its heads go
            options["depth"] = tokens
        return Speculation(HEAD_METHODS[method], options)
    raise InputError(f"--speculative-config method {method!r} is not one of vLLM's that accelgen serves: ngram, "
                     "draft_model, eagle, eagle3, medusa")


def ngram(tokens: int | None, lookup: dict) -> Speculation:
    """vLLM's ngram: prompt lookup decoding (accelgen's pld), its n-gram lengths and draft length."""
    options = {}
    for name, option in (("prompt_lookup_max", "max_ngram"), ("prompt_lookup_min", "min_ngram")):
        value = lookup.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"--speculative-config {name} must be an integer >= 1, got {value!r}")
            options[option] = value
    if "max_ngram" not in options and options.get("min_ngram", 0) > PLD_MAX_NGRAM:
        options["max_ngram"] = options["min_ngram"]  # pld's default maximum, raised to the minimum asked
    if options.get("min_ngram", 1) > options.get("max_ngram", PLD_MAX_NGRAM):
        raise InputError("--speculative-config prompt_lookup_min is over prompt_lookup_max")
    if tokens is not None:
        options["draft_length"] = tokens
    return Speculation("pld", options)


def allowed_origins(values: list[str]) -> tuple[str, ...]:
    """--allowed-origins as vLLM writes it (a JSON list, '["*"]'), or origins comma-separated or repeated."""
    origins: list[str] = []
    for value in values:
        if value.lstrip().startswith("["):
            try:
                listed = json.loads(value)
            except json.JSONDecodeError as error:
                raise InputError(f"--allowed-origins is not a JSON list: {error}") from None
            if not all(isinstance(origin, str) for origin in listed):
                raise InputError(f"--allowed-origins must list strings, got {value}")
            origins += listed
        else:
            origins += [origin.strip() for origin in value.split(",") if origin.strip()]
    return tuple(origins)


def chat_template(value: str) -> str:
    """--chat-template: a file's Jinja template, or (as vLLM allows) the template itself, given inline."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise InputError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def served_model_names(values: list[str]) -> list[str]:
    """--served-model-name, repeated or comma-separated."""
    return [name.strip() for value in values for name in value.split(",") if name.strip()]
