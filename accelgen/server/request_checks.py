"""Reading a checked request body: its prompt or messages, its stop strings, its response_format and tools, and
the sampling arguments Sequence.start takes. What a body can hold but this server does not serve is an APIError."""

from __future__ import annotations

import jsonschema

from accelgen.server.config import ServerConfig
from accelgen.server.errors import APIError
from accelgen.server.schemas import (MAX_STOP_CHARS, MAX_STOP_SEQUENCES, ChatBody, ChatMessage, CompletionBody,
                                     ContentPart, RequestBody, Shape)
from accelgen.server.tools import call_constraint, chosen_tools


UNSUPPORTED_UNLESS_NEUTRAL = {  # field -> the values that mean "not used"
    "logit_bias": (None, {}), "best_of": (None, 1), "suffix": (None, ""),
}


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
    messages = [chat_message(m) for m in body.messages]
    tools = body.tools or []
    try:
        callable_tools = chosen_tools(tools, body.tool_choice)
    except ValueError as error:
        raise APIError(400, str(error), param="tool_choice") from None
    shape = Shape(chat=True, logprobs=(body.top_logprobs or 0) if body.logprobs else None, described_tools=tools,
                  tools=[] if body.tool_choice == "none" else callable_tools,
                  forced_call=call_constraint(tools, body.tool_choice) if tools else None)
    return messages, shape


def chat_message(message: ChatMessage) -> dict:
    """A message as chat templates take it."""
    text = message_text(message.content)
    if message.tool_calls is not None:
        return {"role": message.role, "content": text, "tool_calls": message.tool_calls}
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


def sampling_options(body: RequestBody, shape: Shape, max_tokens: int, stop: list[str]) -> dict:
    """Sequence.start's arguments for this request; the extensions beyond plain sampling only where used."""
    options = dict(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                   stop=stop)
    if body.presence_penalty:
        options["presence_penalty"] = body.presence_penalty
    if body.frequency_penalty:
        options["frequency_penalty"] = body.frequency_penalty
    if shape.logprobs is not None:
        options["logprobs"] = shape.logprobs
    constraint = shape.forced_call or response_constraint(body.response_format)
    if constraint is not None:
        options["response_format"] = constraint
    return options
