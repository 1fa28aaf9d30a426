"""transformers' generate() vocabulary: a drop-in for `model.generate`.

`generate(model, input_ids, ...)` takes what `model.generate` takes (GenerationConfig, attention_mask, streamer,
assistant_model, prompt_lookup_num_tokens, do_sample, ...) and returns what it returns: the sequences with
their prompts, or a `GenerateDecoderOnlyOutput` with return_dict_in_generate=True. So one line changes:

    output = model.generate(**inputs, max_new_tokens=64)                    # before
    output = accelgen.hf.generate(model, **inputs, max_new_tokens=64, method="pld")  # after

HF's settings are read into accelgen's by accelgen/settings.py (`generation_settings`, shared with
accelgen.generate, and named here too). See docs/transformers-drop-in.md.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation import GenerateDecoderOnlyOutput

from accelgen.errors import InputError
from accelgen.loop import generate as accelgen_generate
from accelgen.settings import Settings, generation_settings, set_fields

__all__ = ["Settings", "Wrapped", "generate", "generation_settings", "set_fields", "wrap"]

# transformers' defaults where they change the output, for the drop-in (accelgen.generate keeps its own): top-k 50
# when sampling, and 20 new tokens where neither max_new_tokens nor max_length is set
HF_DEFAULTS = {"top_k": 50}
HF_NEW_TOKENS = 20


class IdsOnly:
    """The tokenizer accelgen's loop is given where the caller has token ids and wants token ids back, as
    `model.generate` needs no tokenizer: no text (results' text is ""), no BOS or EOS of its own."""

    bos_token_id = eos_token_id = pad_token_id = None

    def decode(self, token_ids, **_) -> str:
        return ""


def hf_generation_config(model, generation_config, hf_kwargs: dict) -> tuple[GenerationConfig, dict]:
    """transformers' merge: model.generation_config under generation_config under the keyword arguments, plus
    its defaults where they change the output. Returns the config and the arguments it does not know."""
    merged = GenerationConfig(**{**getattr(model, "generation_config", GenerationConfig()).to_diff_dict(),
                                 **set_fields(generation_config)})
    unknown = merged.update(**hf_kwargs)
    for name, value in HF_DEFAULTS.items():
        if getattr(merged, name) is None:
            setattr(merged, name, value)
    if merged.pad_token_id is None and merged.eos_token_id is not None:  # as transformers, which warns
        eos = merged.eos_token_id
        merged.pad_token_id = eos if isinstance(eos, int) else eos[0]
    return merged, unknown


def generate(model, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, *,
             input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, streamer=None,
             assistant_model=None, tokenizer=None, method: str | None = None, **kwargs):
    """`model.generate(...)` through accelgen: the same arguments, the same return value.

    inputs / input_ids: (batch, L) token ids, left- or right-padded with their attention_mask (or (L,)).
    Returns a (batch, L + new) LongTensor: each row's prompt as given, then its new tokens, rows that ended
    early padded with pad_token_id; with return_dict_in_generate=True a GenerateDecoderOnlyOutput with
    `sequences` and, with output_scores=True, `scores`: a tuple of (batch, vocab) processed scores per step
    (-inf for rows that had ended). method / accelgen options (gamma, seed, ...) as accelgen.generate; tokenizer
    is needed for stop_strings only. assistant_model alone chooses `speculative`, prompt_lookup_num_tokens `pld`.
    """
    if inputs is not None and input_ids is not None:
        raise InputError("pass the prompt once: inputs or input_ids")
    input_ids = inputs if inputs is not None else input_ids
    config, options = hf_generation_config(model, generation_config, kwargs)
    if input_ids is None:  # as transformers: start from BOS
        if config.bos_token_id is None:
            raise InputError("no input_ids and no bos_token_id in the generation config to start from")
        input_ids = torch.tensor([[config.bos_token_id]])
    input_ids = torch.as_tensor(input_ids)
    rows = input_ids if input_ids.dim() == 2 else input_ids[None]
    if config.max_new_tokens is None and config.max_length is None:
        config.max_new_tokens = HF_NEW_TOKENS
    elif config.max_new_tokens is None:  # transformers counts max_length from the padded width
        config.max_new_tokens = config.max_length - rows.shape[-1]
        if config.max_new_tokens < 0:
            raise InputError(f"max_length={config.max_length} is shorter than the {rows.shape[-1]}-token input: "
                             "pass max_new_tokens")
    if config.stop_strings and tokenizer is None:
        raise InputError("stop_strings needs tokenizer= to find them in the text (as transformers' generate)")
    mask = None if attention_mask is None else torch.as_tensor(attention_mask)
    results = accelgen_generate(model, tokenizer or IdsOnly(), rows, attention_mask=mask,
                                generation_config=config, streamer=streamer, method=method,
                                assistant_model=assistant_model, **options)
    results = results if isinstance(results, list) else [results]
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    sequences = torch.cat([rows, padded([result.token_ids for result in results], pad)], dim=1)
    if not config.return_dict_in_generate:
        return sequences if input_ids.dim() == 2 else sequences[0]
    scores = steps_of_scores([result.scores for result in results]) if config.output_scores else None
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores)


def padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    """(batch, longest) LongTensor of the rows, each padded on the right with pad."""
    longest = max(map(len, rows), default=0)
    return torch.tensor([row + [pad] * (longest - len(row)) for row in rows], dtype=torch.long).reshape(len(rows), longest)


def steps_of_scores(scores: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Per-row (new_tokens_i, vocab) scores -> transformers' layout: a (batch, vocab) tensor per step, -inf where
    a row had already ended."""
    steps = max(len(row) for row in scores)
    table = torch.full((len(scores), steps, scores[0].shape[-1]), float("-inf"))
    for row, row_scores in enumerate(scores):
        table[row, : len(row_scores)] = row_scores
    return tuple(table[:, step] for step in range(steps))


class Wrapped:
    """A model whose `generate` is accelgen's drop-in, with fixed accelgen arguments (method, tokenizer, ...);
    every other attribute is the model's."""

    def __init__(self, model, **arguments):
        self.model = model
        self.arguments = arguments

    def generate(self, inputs=None, generation_config=None, **kwargs):
        return generate(self.model, inputs, generation_config, **{**self.arguments, **kwargs})

    def __getattr__(self, name):
        return getattr(self.model, name)


def wrap(model, **arguments) -> Wrapped:
    """`wrap(model, method="pld").generate(**inputs, max_new_tokens=64)` in place of `model.generate(...)`."""
    return Wrapped(model, **arguments)
