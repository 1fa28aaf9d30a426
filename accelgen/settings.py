"""HF's generation settings read into accelgen's: one call's arguments, a GenerationConfig and the model's own
`generation_config` merged as transformers merges them, into the arguments of the generation loop.

`generation_settings` is the translation both entry points share: accelgen.generate reads a GenerationConfig,
`model.generation_config` and HF's argument names through it, and the transformers drop-in (accelgen/hf.py) hands
them on to accelgen.generate. It sits below the loop, which reads its `Settings`. See docs/transformers-drop-in.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from accelgen.errors import InputError
from accelgen.registry import check_option, get_method

# accelgen's own defaults: the last layer, under the explicit arguments, a GenerationConfig and the model's
ACCELGEN_DEFAULTS = {"method": "autoregressive", "max_new_tokens": 128, "temperature": 0.0, "top_k": 0, "top_p": 1.0}

# GenerationConfig fields accelgen takes under the same name, with the value that changes nothing
SAME_NAMES = {"max_new_tokens": None, "top_k": None, "top_p": None, "repetition_penalty": 1.0,
              "no_repeat_ngram_size": 0, "min_new_tokens": 0, "bad_words_ids": None, "output_scores": False}
# fields read under another name or meaning (config_arguments), and arguments only transformers' generate takes
TRANSLATED = ("do_sample", "temperature", "max_length", "stop_strings", "eos_token_id", "pad_token_id",
              "cache_implementation", "num_assistant_tokens", "num_assistant_tokens_schedule", "prompt_lookup_num_tokens",
              "max_matching_ngram_size", "logits_processor", "assistant_model")
HF_ARGUMENTS = ("assistant_model", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
                "synced_gpus", "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate",
                "assistant_tokenizer")
# fields that change how transformers runs, not which tokens come out (the last one shapes what hf.generate returns)
NO_EFFECT = ("use_cache", "cache_config", "max_cache_len", "compile_config", "disable_compile",
             "prefill_chunk_size", "continuous_batching_config", "bos_token_id", "decoder_start_token_id",
             "is_assistant", "low_memory", "transformers_version", "_from_model_config", "return_dict_in_generate")
# what to use instead of a field or argument accelgen cannot honour
INSTEAD = {
    "num_beams": "beam search is not supported: accelgen decodes greedily or samples (num_beams=1)",
    "num_return_sequences": "call generate once per sample with its own seed, or ask the server for n",
    "min_length": "use min_new_tokens",
    "typical_p": "accelgen samples with temperature, top_k and top_p",
    "min_p": "accelgen samples with temperature, top_k and top_p",
    "epsilon_cutoff": "accelgen samples with temperature, top_k and top_p",
    "eta_cutoff": "accelgen samples with temperature, top_k and top_p",
    "max_time": "use max_new_tokens, or stream=True and stop reading",
    "output_logits": "output_scores gives the processed scores",
    "suppress_tokens": "use bad_words_ids=[[token], ...]",
    "assistant_early_exit": "use method='layerskip' with exit_layer=...",
    "assistant_confidence_threshold": "speculative's option is confidence_threshold",
    "assistant_tokenizer": "use method='universal' with draft_tokenizer=...",
    "stopping_criteria": "use stop= (strings), eos_token_id= or max_new_tokens",
    "prefix_allowed_tokens_fn": "use response_format= (JSON schema) or logits_processors=",
}
GAMMA_SCHEDULES = {"constant": "constant", "heuristic": "heuristic"}  # HF's num_assistant_tokens_schedule -> ours
HF_FIELDS = frozenset(vars(GenerationConfig()))
# accelgen.generate()'s own arguments, None when not given
GENERATE_ARGUMENTS = frozenset({"method", "draft_model", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop"})
# transformers' own defaults, which change nothing (GenerationConfig() leaves its fields None until set)
NEUTRAL = getattr(GenerationConfig(), "_get_default_generation_params", dict)()


@dataclass
class Settings:
    """One call's generation settings in accelgen's terms."""

    arguments: dict  # keyword arguments of Sequence.start
    max_length: int | None  # prompt + new tokens, where no layer sets max_new_tokens
    eos_token_ids: list[int] | None  # replace the model's and tokenizer's EOS ids where given
    pad_token_id: int | None


def set_fields(generation_config) -> dict:
    """The fields a GenerationConfig sets: those that differ from GenerationConfig()'s (None in transformers 5)."""
    if generation_config is None:
        return {}
    if not isinstance(generation_config, GenerationConfig):
        raise InputError(f"generation_config must be a transformers GenerationConfig, "
                         f"not {type(generation_config).__name__}")
    return generation_config.to_diff_dict()


def generation_settings(model, generation_config, given: dict) -> Settings:
    """Read the arguments of one call as transformers does: the `given` arguments (accelgen's names and HF's,
    None meaning not given) win, then `generation_config`'s fields, then `model.generation_config`'s fields,
    then accelgen's defaults. A field that would change the output in a way accelgen cannot honour is an error."""
    # None means "not given" for generate()'s own arguments and transformers' names; a method option set to None
    # (lookahead-decoding's max_nodes=None: no cap) is a value
    given = {name: value for name, value in given.items()
             if value is not None or name not in GENERATE_ARGUMENTS | HF_FIELDS | set(HF_ARGUMENTS)}
    model_config = getattr(model, "generation_config", None)  # (a runner of another kind may have none)
    fields = {name: (value, "model.generation_config") for name, value in
              set_fields(model_config if isinstance(model_config, GenerationConfig) else None).items()}
    fields.update((name, (value, "generation_config")) for name, value in set_fields(generation_config).items())
    # HF's names given as arguments join the config's fields, and temperature too where do_sample is given with it:
    # alone, an explicit temperature keeps accelgen's meaning (0 greedy, else sampling)
    hf_names = HF_FIELDS - set(SAME_NAMES) | set(HF_ARGUMENTS)
    if "do_sample" not in given:
        hf_names -= {"temperature"}
    fields.update((name, (given.pop(name), "argument")) for name in list(given) if name in hf_names)
    refuse_what_cannot_be_honoured(fields)
    values = {name: value for name, (value, _) in fields.items()}
    if "assistant_model" in values and "draft_model" in given:
        raise InputError("assistant_model is transformers' name for draft_model: pass one of them")
    method = given.get("method") or implied_method(values) or ACCELGEN_DEFAULTS["method"]
    from_model = {name for name, (_, source) in fields.items() if source == "model.generation_config"}
    arguments = {**ACCELGEN_DEFAULTS, **config_arguments(values, method, from_model), **given, "method": method}
    if values.get("stop_strings") and given.get("stop"):  # both names: every stop string counts
        arguments["stop"] = list(as_list(values["stop_strings"])) + list(as_list(given["stop"]))
    if "logits_processor" in values:  # HF's processors, row by row: (1, n) ids and (1, vocab) scores
        arguments["logits_processors"] = [*map(row_processor, values["logits_processor"]),
                                          *(given.get("logits_processors") or [])]
    max_length = None
    if "max_new_tokens" not in given and values.get("max_new_tokens") is None and values.get("max_length") is not None:
        max_length = values["max_length"]
        del arguments["max_new_tokens"]
    eos, source = fields.get("eos_token_id", (None, None))
    if source == "model.generation_config":
        eos = None  # the loop reads the model's EOS ids anyway (with the tokenizer's)
    return Settings(arguments, max_length, [eos] if isinstance(eos, int) else eos, values.get("pad_token_id"))


def as_list(texts) -> list:
    return [texts] if isinstance(texts, str) else list(texts)


def row_processor(processor):
    """A transformers LogitsProcessor as an accelgen one: (context_ids (n,), logits (vocab,)) -> logits."""
    def process(context_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return processor(context_ids[None], logits[None].clone())[0]  # (it may write into the scores)
    return process


def refuse_what_cannot_be_honoured(fields: dict) -> None:
    """A ValueError for a field or argument set to a value that would change the output in a way accelgen cannot
    reproduce (a field at transformers' own default changes nothing and passes; so do fields it does not know)."""
    for name, (value, source) in fields.items():
        if name in SAME_NAMES or name in TRANSLATED or name in NO_EFFECT or name not in HF_FIELDS | set(HF_ARGUMENTS):
            continue
        if value is None or value is False or value == NEUTRAL.get(name):
            continue
        instead = INSTEAD.get(name, "accelgen has no equivalent")
        raise InputError(f"accelgen cannot honour {name}={value!r} (from {source}): {instead}")


def implied_method(values: dict) -> str | None:
    """The method HF's arguments choose: its assisted generation or its prompt lookup."""
    if values.get("assistant_model") is not None and values.get("prompt_lookup_num_tokens") is not None:
        raise InputError("assistant_model and prompt_lookup_num_tokens choose two methods: pass one of them")
    if values.get("assistant_model") is not None:
        return "speculative"
    if values.get("prompt_lookup_num_tokens") is not None:
        return "pld"
    return None


def config_arguments(values: dict, method: str, from_model: set[str] = frozenset()) -> dict:
    """GenerationConfig fields (and HF's arguments) as Sequence.start arguments for this method (from_model: the
    fields only model.generation_config set)."""
    arguments = {name: values[name] for name, neutral in SAME_NAMES.items()
                 if values.get(name) is not None and values[name] != neutral}
    if values.get("do_sample"):
        arguments["temperature"] = values.get("temperature", 1.0)
        check_option("temperature", arguments["temperature"], (float,))
        if arguments["temperature"] <= 0:
            raise InputError(f"do_sample=True needs temperature > 0, got {arguments['temperature']}")
    elif "do_sample" in values or "temperature" in values:
        arguments["temperature"] = 0.0  # transformers: greedy unless do_sample, whatever the temperature
    if values.get("stop_strings"):
        arguments["stop"] = values["stop_strings"]
    if values.get("assistant_model") is not None:
        arguments["draft_model"] = values["assistant_model"]
    if values.get("cache_implementation") is not None:
        arguments["cache"] = cache_choice(values["cache_implementation"])
    options = get_method(method).options
    renamed = {"num_assistant_tokens": "gamma", "num_assistant_tokens_schedule": "gamma_schedule",
               "prompt_lookup_num_tokens": "draft_length", "max_matching_ngram_size": "max_ngram"}
    for hf_name, name in renamed.items():
        value = values.get(hf_name)
        if value is None or (hf_name in from_model and name not in options):
            continue  # a model's own config may set knobs for methods other than this one
        if name not in options:
            raise InputError(f"{hf_name} sets {name}, an option method {method!r} does not have")
        if hf_name == "num_assistant_tokens_schedule":
            if value not in GAMMA_SCHEDULES:
                raise InputError(f"num_assistant_tokens_schedule={value!r}: accelgen's gamma_schedule takes "
                                 f"{', '.join(GAMMA_SCHEDULES)} (or 'cost')")
            value = GAMMA_SCHEDULES[value]
        arguments[name] = value
    return arguments


def cache_choice(cache_implementation: str) -> str:
    """transformers' cache_implementation as accelgen's cache: "static" is accelgen's static cache (with CUDA graphs
    on a GPU), "dynamic" its growing one; HF's other caches (offloaded, quantized, sliding) have no counterpart."""
    if cache_implementation in ("static", "dynamic"):
        return cache_implementation
    raise InputError(f"cache_implementation={cache_implementation!r}: accelgen keeps a 'static' or a 'dynamic' KV "
                     f"cache (its cache= argument)")
