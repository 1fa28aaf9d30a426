"""The OpenAPI document (/openapi.json) as the API is: every status code an operation answers, with its body
(OpenAI's error object), /metrics as Prometheus text, and the request bodies with the limits the server enforces.

FastAPI derives the bodies from schemas.py. Where the server refuses a value with a reason of its own rather than
by pydantic (request_checks.py: fields accepted at their neutral value only, stop strings, token ids, the
operator's limits), the schema says so here, built from the same tables and limits, so that a request valid by
the document is one the server serves. The rules JSON Schema cannot state (a prompt's length in tokens, a
tool_choice naming one of the tools, ...) are listed in the 400 response's description (UNSTATED_RULES).
"""

from __future__ import annotations

import json

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from accelgen.server.config import ServerConfig
from accelgen.server.metrics import CONTENT_TYPE
from accelgen.server.request_checks import (TEMPLATE_OPTIONS, UNSUPPORTED_UNLESS_NEUTRAL,
                                            VLLM_UNSUPPORTED_UNLESS_NEUTRAL)
from accelgen.server.schemas import MAX_STOP_CHARS, MAX_STOP_SEQUENCES


class ErrorObject(BaseModel):
    message: str
    type: str  # invalid_request_error, authentication_error, rate_limit_error, server_error
    param: str | None
    code: int  # the HTTP status


class ErrorBody(BaseModel):
    """OpenAI's error shape, the body of every answer that is not a 200."""

    error: ErrorObject


class Reply(BaseModel):
    """What a 200 of /v1/completions or /v1/chat/completions holds (openai_format.Reply; choices differ)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: str  # text_completion, chat.completion
    created: int
    model: str
    choices: list[dict]
    usage: dict
    accelgen: dict  # accelgen's statistics of the reply: its method, drafts and acceptance


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    methods: list[str]


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class Health(BaseModel):
    status: str  # ok, starting
    detail: str | None = None


ERRORS = {
    400: "Invalid request: the body is not valid JSON, fails the schema, or asks for what this server does not "
         "serve (the message says which field and why)",
    401: "Missing or wrong API key (only when the server was started with --api-key)",
    404: "No such model here (its name is not among the served names)",
    408: "The request body did not arrive within the server's body timeout",
    411: "No Content-Length header",
    413: "The request body is over the server's limit",
    429: "Server busy: as many requests in flight as it admits; try again later",
    500: "Internal error (a bug), or generation failed",
    503: "Shutting down (or the engine stopped): the request was not started",
}
# rules the server checks that JSON Schema cannot state; the 400's description lists them
UNSTATED_RULES = {
    "prompt": "the prompt (chat: the messages as the chat template renders them) has at most the server's "
              "--max-model-len tokens",
    "min_tokens": "min_tokens is at most the request's max_tokens (or max_completion_tokens)",
    "tool_choice": "a tool_choice naming a function names one of the request's tools",
    "response_format": "a json_schema's schema (guided_json, a tool's parameters) is a valid JSON Schema",
    "messages": "the model's chat template accepts the messages (e.g. the order of roles; a model without a chat "
                "template serves no chat requests)",
}
POST_ERRORS = (400, 401, 404, 408, 411, 413, 429, 500, 503)


def error_responses(*statuses: int) -> dict:
    """FastAPI's `responses=` for these error statuses, each with OpenAI's error body."""
    return {status: {"model": ErrorBody, "description": ERRORS[status]} for status in statuses}


def streamed(description: str) -> dict:
    """A 200 that is JSON, or server-sent events (`data: {chunk}` lines, then `data: [DONE]`) with "stream": true."""
    return {200: {"model": Reply, "description": description, "content": {
        # each event (OpenAPI 3.1: the schema of a stream is its events'): a chunk's JSON, the last "[DONE]"
        "text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                         "properties": {"data": {"type": "string"}}}}}}}


METRICS_RESPONSE = {200: {"description": "Prometheus text exposition format",
                          "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}}
HEALTH_RESPONSES = {200: {"model": Health, "description": "Ready"},
                    503: {"model": Health, "description": "Starting (e.g. timing forwards for its speculation policy)"}}


def install(app: FastAPI, config: ServerConfig, methods: list[str]) -> None:
    """Serve this server's document at /openapi.json: FastAPI's, made to say what the server accepts."""

    def document() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description="An OpenAI-compatible API (docs/server.md)")
            app.openapi_schema = describe(schema, config, methods)
        return app.openapi_schema

    app.openapi = document


def describe(schema: dict, config: ServerConfig, methods: list[str]) -> dict:
    """The document with the limits the server enforces and its own error answers (no 422: validation fails 400)."""
    components = schema["components"]["schemas"]
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path in schema["paths"].values():
        for operation in path.values():
            operation["responses"].pop("422", None)
            if "400" in operation["responses"]:
                operation["responses"]["400"]["description"] += (
                    ". Beyond the schema, the server checks: " + "; ".join(UNSTATED_RULES.values()))
    vocab = getattr(getattr(config.model, "config", None), "vocab_size", None)
    token_id = {"type": "integer", "minimum": 0} | ({"maximum": vocab - 1} if vocab else {})
    request_fields(components, config, methods, token_id)
    completion_fields(components["CompletionBody"], token_id)
    chat_fields(components)
    for path in schema["paths"].values():  # a model's path names one of the served models
        for operation in path.values():
            for parameter in operation.get("parameters", []):
                if parameter["name"] == "model_id":
                    parameter["schema"] = {"type": "string", "enum": config.served_names}
    return schema


def nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def request_fields(components: dict, config: ServerConfig, methods: list[str], token_id: dict) -> None:
    """The fields both bodies share (schemas.RequestBody), with the operator's limits."""
    stop = {"type": "string", "maxLength": MAX_STOP_CHARS}
    neutral = dict(UNSUPPORTED_UNLESS_NEUTRAL) | {name: values for name, (values, _) in VLLM_UNSUPPORTED_UNLESS_NEUTRAL.items()}
    reasons = {name: why for name, (_, why) in VLLM_UNSUPPORTED_UNLESS_NEUTRAL.items()}
    json_schema = {"type": "object", "description": "a JSON Schema"}
    for body in ("CompletionBody", "ChatBody"):
        fields = components[body]["properties"]
        updates = {
            "model": nullable({"type": "string", "enum": config.served_names}),
            "method": nullable({"type": "string", "enum": sorted(methods)}),
            "max_tokens": nullable({"type": "integer", "minimum": 0, "maximum": config.max_tokens}),
            "max_completion_tokens": nullable({"type": "integer", "minimum": 0, "maximum": config.max_tokens}),
            "min_tokens": {"type": "integer", "minimum": 0, "maximum": config.max_tokens, "default": 0},
            "stop": nullable({"anyOf": [stop, {"type": "array", "items": stop, "maxItems": MAX_STOP_SEQUENCES}]}),
            "stop_token_ids": nullable({"type": "array", "items": token_id}),
            "allowed_token_ids": nullable({"type": "array", "items": token_id, "minItems": 1}),
            "truncate_prompt_tokens": nullable({"anyOf": [
                {"const": -1, "description": "the server's --max-model-len"},
                {"type": "integer", "minimum": 1, "maximum": config.max_prompt_tokens}]}),
            "stream_options": nullable({"type": "object", "properties": {
                "include_usage": {"type": "boolean"}, "continuous_usage_stats": {"type": "boolean"}}}),
            "response_format": nullable({"oneOf": [
                {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"]},
                {"type": "object", "required": ["type", "json_schema"], "properties": {
                    "type": {"const": "json_schema"},
                    "json_schema": {"type": "object", "required": ["name"], "properties": {
                        "name": {"type": "string"}, "schema": json_schema,
                        "strict": {"type": ["boolean", "null"]}}}}}]}),
            # a schema, or the same schema as JSON text (documented as the object only: any text is not one)
            "guided_json": nullable(json_schema),
            "structured_outputs": nullable({"type": "object", "properties": {"json": json_schema},
                                            "additionalProperties": False}),
        }
        for name, values in neutral.items():
            if name in fields:  # accepted at the value that means "not used" only
                why = reasons.get(name, "not supported here")
                updates[name] = {"enum": list(values), "description": f"only {values[0]!r} and the like: {why}"}
        for name, update in updates.items():
            fields[name] = {"title": fields[name].get("title", name)} | update | (
                {"default": fields[name]["default"]} if "default" in fields[name] else {})
        # one constraint at a time: response_format, or vLLM's guided_json (structured_outputs.json)
        components[body]["allOf"] = [
            {"not": {"required": ["response_format", "guided_json"], "properties": {
                "response_format": {"type": "object"}, "guided_json": {"type": "object"}}}},
            {"not": {"required": ["response_format", "structured_outputs"], "properties": {
                "response_format": {"type": "object"},
                "structured_outputs": {"type": "object", "required": ["json"]}}}}]


def completion_fields(body: dict, token_id: dict) -> None:
    """One prompt per request, never empty; echo with logprobs is not served."""
    fields = body["properties"]
    ids = {"type": "array", "items": token_id, "minItems": 1}
    fields["prompt"] = {"title": "Prompt", "anyOf": [
        {"type": "string", "minLength": 1}, ids,
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}]}
    body["allOf"].append({"not": {"required": ["echo", "logprobs"], "properties": {
        "echo": {"const": True}, "logprobs": {"type": "integer"}}}})


def chat_fields(components: dict) -> None:
    """Text content parts only; top_logprobs needs logprobs; tool_choice "required" or named needs tools; tools
    take neither a JSON response_format nor the chat template's options."""
    components["ContentPart"] = {"title": "ContentPart", "type": "object", "required": ["type", "text"],
                                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    body = components["ChatBody"]
    tools = {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}
    body["allOf"] += [
        {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
         "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
        {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": [None, "auto", "none"]}}}},
         "then": tools},
        {"if": tools, "then": {"properties": {
            "response_format": {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]},
            **{name: {"const": default} for name, default in TEMPLATE_OPTIONS.items()}}}},
    ]
