"""Reading a checked request body: its prompt or messages, its stop strings, its response_format and tools, and
the sampling arguments Sequence.start takes. What a body can hold but this server does not serve is an APIError."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import jsonschema

from accelgen.processors import AllowedTokens, MinP
from accelgen.prompts import encode_prompt, eos_token_ids
from accelgen.server.config import ServerConfig
from accelgen.server.errors import APIError
from accelgen.server.schemas import (MAX_STOP_CHARS, MAX_STOP_SEQUENCES, ChatBody, ChatMessage, CompletionBody,
                                     ContentPart, RequestBody, Shape)
from accelgen.server.tools import call_constraint, chosen_tools


UNSUPPORTED_UNLESS_NEUTRAL = {  # field -> the values that mean "not used"
    "logit_bias": (None, {}), "best_of": (None, 1), "suffix": (None, ""),
}
# vLLM's extra fields with no counterpart here: field -> (the values that mean "not used", why the rest is refused)
NOT_GUIDED = "accelgen constrains output by JSON schema only (response_format or guided_json)"
VLLM_UNSUPPORTED_UNLESS_NEUTRAL = {
    "use_beam_search": ((False,), "beam search is not implemented here"),
    "length_penalty": ((1.0,), "length_penalty applies to beam search, which is not implemented here"),
    "prompt_logprobs": ((None,), "the prompt's tokens have no logprobs here"),
    "logits_processors": ((None, []), "a request may not name code for the server to load"),
    "return_tokens_as_token_ids": ((None, False), "logprobs name tokens by their text here"),
    "return_token_ids": ((None, False), "replies carry text, not token ids"),
    "guided_regex": ((None,), NOT_GUIDED), "guided_choice": ((None,), NOT_GUIDED),
    "guided_grammar": ((None,), NOT_GUIDED), "structural_tag": ((None,), NOT_GUIDED),
    "guided_whitespace_pattern": ((None,), "the JSON grammar decides the whitespace it allows"),
    "priority": ((0,), "requests are served in arrival order (no priority scheduling)"),
    "kv_transfer_params": ((None,), "there is no disaggregated prefill here"),
    "vllm_xargs": ((None, {}), "no plugin here reads vllm_xargs"),
    "mm_processor_kwargs": ((None, {}), "only text is served here"),
    "prompt_embeds": ((None,), "prompts are text or token ids here"),
}
TEMPLATE_OPTIONS = {  # ChatBody field -> its default: any other value renders the messages here (chat_prompt)
    "add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False, "documents": None,
    "chat_template": None, "chat_template_kwargs": None,
}


@dataclass
class PromptText:
    """How a request's prompt is tokenized and its answer read (vLLM's fields): the chat template's arguments,
    special tokens, truncation; Output.set_text_options' arguments; the reply's id."""

    template: dict | None = None  # apply_chat_template's arguments (None: encode_prompt's defaults)
    add_special_tokens: bool | None = None  # None: encode_prompt's default
    truncate: int | None = None  # keep this many prompt tokens
    truncation_side: str = "left"
    output: dict = field(default_factory=dict)
    request_id: str | None = None


def check_neutral(body: RequestBody) -> None:
    """Refuse, by name and with the reason, a field this server accepts only at the value that means "not used"."""
    for name, value in body:
        if name in UNSUPPORTED_UNLESS_NEUTRAL and value not in UNSUPPORTED_UNLESS_NEUTRAL[name]:
            raise APIError(400, f"{name}={value!r} is not supported", param=name)
        if name in VLLM_UNSUPPORTED_UNLESS_NEUTRAL:
            neutral, why = VLLM_UNSUPPORTED_UNLESS_NEUTRAL[name]
            if value not in neutral:
                raise APIError(400, f"{name}={value!r} is not supported: {why}", param=name)


def prompt_text(body: RequestBody, config: ServerConfig) -> PromptText:
    """The PromptText of a checked request."""
    truncate = body.truncate_prompt_tokens
    if truncate == 0:
        raise APIError(400, "truncate_prompt_tokens must be >= 1 (or -1: the server's limit)",
                       param="truncate_prompt_tokens")
    if truncate is not None and truncate > config.max_prompt_tokens:
        raise APIError(400, f"truncate_prompt_tokens {truncate} is over this server's prompt limit of "
                            f"{config.max_prompt_tokens} (--max-model-len)", param="truncate_prompt_tokens")
    text = PromptText(truncate=config.max_prompt_tokens if truncate == -1 else truncate,
                      truncation_side=body.truncation_side or "left", request_id=body.request_id,
                      output=dict(skip_special_tokens=body.skip_special_tokens,
                                  spaces_between_special_tokens=body.spaces_between_special_tokens,
                                  include_stop=body.include_stop_str_in_output, min_tokens=body.min_tokens))
    if isinstance(body, ChatBody):
        if any(getattr(body, name) != default for name, default in TEMPLATE_OPTIONS.items()):
            text.template = {name: getattr(body, name) for name in TEMPLATE_OPTIONS}
    elif not body.add_special_tokens:
        text.add_special_tokens = False
    return text


def prompt_ids(tokenizer, prompt, text: PromptText):
    """The prompt as Sequence.start takes it: as given, or token ids where the request's PromptText says how
    to tokenize or truncate it. Raises ValueError (a 400) where the chat template refuses its arguments."""
    if text.template is not None and isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        options = dict(text.template)
        add_special_tokens = options.pop("add_special_tokens")
        kwargs = options.pop("chat_template_kwargs") or {}
        if options["documents"] is None:
            options.pop("documents")
        rendered = tokenizer.apply_chat_template(prompt, tokenize=False, **kwargs, **options)
        prompt = tokenizer(rendered, add_special_tokens=add_special_tokens).input_ids
    elif text.add_special_tokens is False and isinstance(prompt, str):
        prompt = tokenizer(prompt, add_special_tokens=False).input_ids
    if text.truncate is None:
        return prompt
    ids = encode_prompt(tokenizer, prompt)
    return ids[-text.truncate:] if text.truncation_side == "left" else ids[: text.truncate]


def completion_prompt(body: CompletionBody):
    """The one prompt of a completion request: text or token ids."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (the prompt's tokens have no logprobs here)",
                       param="echo")
    return prompt


def chat_request(body: ChatBody, config: ServerConfig) -> tuple[list[dict], Shape]:
    """(the messages, the Shape of the answer) of a chat request: its logprobs and its tools."""
    if getattr(config.tokenizer, "chat_template", None) is None:
        raise APIError(400, f"{config.model_name} has no chat template: use /v1/completions")
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if body.tool_choice not in (None, "auto", "none") and not body.tools:
        raise APIError(400, f"tool_choice {body.tool_choice!r} needs tools", param="tool_choice")
    if body.tools and response_constraint(body.response_format) is not None:
        raise APIError(400, "give tools or a JSON response_format, not both", param="response_format")
    if body.tools and any(getattr(body, name) != default for name, default in TEMPLATE_OPTIONS.items()):
        raise APIError(400, f"the chat template options ({', '.join(TEMPLATE_OPTIONS)}) cannot be combined with "
                            "tools here", param="tools")
    messages = [chat_message(m) for m in body.messages]
    tools = body.tools or []
    try:
        callable_tools = chosen_tools(tools, body.tool_choice)
    except ValueError as error:
        raise APIError(400, str(error), param="tool_choice") from None
    shape = Shape(chat=True, logprobs=(body.top_logprobs or 0) if body.logprobs else None, described_tools=tools,
                  tools=[] if body.tool_choice == "none" else callable_tools,
                  forced_call=call_constraint(tools, body.tool_choice) if tools else None)
    if body.echo and messages[-1]["role"] == "assistant":  # vLLM's: the answer continues that message
        shape.chat_echo = messages[-1]["content"]
    return messages, shape


def chat_message(message: ChatMessage) -> dict:
    """A message as chat templates take it."""
    text = message_text(message.content)
    if message.tool_calls is not None:
        return {"role": message.role, "content": text, "tool_calls": [call.model_dump() for call in message.tool_calls]}
    if message.tool_call_id is not None:
        return {"role": message.role, "content": text, "tool_call_id": message.tool_call_id}
    return {"role": message.role, "content": text}


def message_text(content: str | list[ContentPart] | None) -> str:
    """A chat message's text; content parts of type "text" are joined (images and audio are refused)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text":
            raise APIError(400, f"message content of type {part.type!r} is not supported", param="messages")
        if part.text is None:
            raise APIError(400, "a content part of type 'text' needs a string field 'text'", param="messages")
        texts.append(part.text)
    return "".join(texts)


def response_constraint(response_format: dict | None) -> dict | None:
    """The checked response_format as Sequence.start takes it (OpenAI's form), or None for free text."""
    kind = (response_format or {"type": "text"}).get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise APIError(400, f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
                       param="response_format")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("schema", {}), dict):
        raise APIError(400, "response_format json_schema needs \"json_schema\": {\"name\": ..., \"schema\": {...}}",
                       param="response_format")
    schema = spec.get("schema", {})
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        raise APIError(400, f"response_format: not a valid JSON schema: {error.message}", param="response_format") from None
    return {"type": "json_schema", "json_schema": {"name": spec["name"], "schema": schema, "strict": spec.get("strict")}}


def check_stop(stop: str | list[str] | None) -> list[str]:
    """The stop strings as a list, within the limits (MAX_STOP_SEQUENCES, MAX_STOP_CHARS)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise APIError(400, f"stop: at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}", param="stop")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise APIError(400, f"stop: a stop sequence of {longest} characters is over the limit of {MAX_STOP_CHARS}",
                       param="stop")
    return stops


def sampling_options(body: RequestBody, shape: Shape, max_tokens: int, stop: list[str], config: ServerConfig) -> dict:
    """Sequence.start's arguments for this request; the extensions beyond plain sampling only where used."""
    options = dict(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                   top_k=max(body.top_k, 0), stop=stop)  # vLLM's top_k -1 is accelgen's 0: off
    options.update(vllm_sampling(body, max_tokens, config))
    if body.presence_penalty:
        options["presence_penalty"] = body.presence_penalty
    if body.frequency_penalty:
        options["frequency_penalty"] = body.frequency_penalty
    if shape.logprobs is not None:
        options["logprobs"] = shape.logprobs
    constraint = shape.forced_call or response_constraint(guided_format(body))
    if constraint is not None:
        options["response_format"] = constraint
    return options


def vllm_sampling(body: RequestBody, max_tokens: int, config: ServerConfig) -> dict:
    """Sequence.start's arguments for vLLM's sampling fields, where they are used."""
    options = {}
    if body.repetition_penalty != 1.0:
        options["repetition_penalty"] = body.repetition_penalty
    if body.min_tokens:
        if body.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens {body.min_tokens} is over max_tokens {max_tokens}", param="min_tokens")
        options["min_new_tokens"] = body.min_tokens
    vocab_size = config.model.config.vocab_size
    outside = [token for token in body.stop_token_ids or [] if not 0 <= token < vocab_size]
    if outside:
        raise APIError(400, f"stop_token_ids holds {outside[0]}, not a token id of this model (0..{vocab_size - 1})",
                       param="stop_token_ids")
    if body.ignore_eos or body.stop_token_ids:  # stop_token_ids end generation as EOS does (and ignore_eos keeps them)
        eos = set() if body.ignore_eos else eos_token_ids(config.model, config.tokenizer)
        options["eos_ids"] = eos | set(body.stop_token_ids or [])
    if body.bad_words:
        options["bad_words_ids"] = bad_words_ids(config.tokenizer, body.bad_words)
    processors = []
    if body.allowed_token_ids is not None:  # first, as in vLLM: min_p then weighs the allowed tokens only
        try:
            processors.append(AllowedTokens(body.allowed_token_ids, vocab_size))
        except ValueError as error:
            raise APIError(400, str(error), param="allowed_token_ids") from None
    if body.min_p and body.temperature > 0:  # greedy decoding keeps the most likely token, which min_p never drops
        processors.append(MinP(body.min_p, body.temperature))
    if processors:
        options["logits_processors"] = processors
    return options


def bad_words_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's bad_words as token sequences: each word alone and after a space (how it appears mid-sentence)."""
    sequences = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer(text, add_special_tokens=False).input_ids
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def guided_format(body: RequestBody) -> dict | None:
    """The response_format, or vLLM's guided_json (structured_outputs.json) as one."""
    schema = body.guided_json
    if body.structured_outputs is not None:
        if set(body.structured_outputs) - {"json"}:
            raise APIError(400, f"structured_outputs {sorted(body.structured_outputs)} is not supported: "
                                f"{NOT_GUIDED}", param="structured_outputs")
        schema = body.structured_outputs.get("json", schema)
    if schema is None:
        return body.response_format
    if body.response_format is not None:
        raise APIError(400, "give response_format or guided_json, not both", param="guided_json")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise APIError(400, f"guided_json is not JSON: {error}", param="guided_json") from None
    return {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": schema}}
