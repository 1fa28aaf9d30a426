"""The request bodies of /v1/completions and /v1/chat/completions (pydantic, strict), their limits, and the Shape
of the answer a request asks for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from accelgen.server.tools import Tool, ToolCall, ToolChoice


# OpenAI allows 4 stop sequences. The matcher costs time linear in their length (stopping.py), but a stop
# string is text the server keeps and scans for the request's whole life, and nothing a client means by
# "stop here" is longer than a few lines: 1,000 characters is far beyond any real use, and bounds the work.
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 1000
MAX_N = 8  # choices per request: each is a sequence in the batch
MAX_TOP_LOGPROBS = 20  # OpenAI's limits: 20 alternatives per token in chat, 5 in completions
MAX_COMPLETION_LOGPROBS = 5


class RequestBody(BaseModel):
    # strict: a string is not a number, a number is not a boolean ("10", true and "yes" are refused, not coerced);
    # an integer is still a valid float (temperature 0)
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63 - MAX_N)  # what a torch generator takes, + i
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    top_k: int = Field(default=0, ge=-1)  # an extension (vLLM's): 0 or -1 keeps every token
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    response_format: dict | None = None
    # OpenAI fields accepted at their neutral values only (clients often send them); anything else is refused
    logit_bias: dict | None = None
    method: str | None = None  # accelgen's extra field: the generation method
    # vLLM's extra parameters (docs/server.md, "For vLLM users"): honoured, or refused by name where accelgen has
    # no counterpart (VLLM_UNSUPPORTED_UNLESS_NEUTRAL in request_checks.py)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # -1: the server's --max-model-len
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    guided_json: str | dict | None = None
    guided_decoding_backend: str | None = None  # accepted: accelgen's own grammar engine constrains
    request_id: str | None = None
    cache_salt: str | None = None  # accepted: no cache is shared between requests here, so nothing to salt
    use_beam_search: bool = False
    length_penalty: float = 1.0
    prompt_logprobs: int | None = None
    logits_processors: list | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None
    structured_outputs: dict | None = None
    priority: int = 0
    kv_transfer_params: dict | None = None
    vllm_xargs: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def whole_numbers(cls, data):
        """2.0 is the integer 2, as JSON Schema (the OpenAPI document) has it: for the fields and their lists of
        numbers (token ids), not inside objects, which are the client's own (a JSON schema, a document)."""
        return {name: whole(value) for name, value in data.items()} if isinstance(data, dict) else data


def whole(value):
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return [whole(item) for item in value] if isinstance(value, list) else value


class CompletionBody(RequestBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)  # alternatives per token
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (or other special tokens) before the prompt
    prompt_embeds: str | list | None = None  # vLLM's; refused (request_checks.py)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # other part types are refused by name (message_text)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)  # other OpenAI message fields (name, refusal) are ignored

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call


class ChatBody(RequestBody):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; an answer makes at most one call
    # vLLM's chat extras: how the chat template renders the messages (request_checks.chat_prompt)
    echo: bool = False  # the last message's content before the answer, when it is the assistant's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    mm_processor_kwargs: dict | None = None


@dataclass
class Shape:
    """How a request is asked and answered: chat or completion, logprobs (alternatives per token, None: off), the
    prompt echoed before a completion, the tools (a call is returned as tool_calls)."""

    chat: bool
    logprobs: int | None = None
    echo: bool = False
    described_tools: list[Tool] = field(default_factory=list)  # in the prompt
    tools: list[Tool] = field(default_factory=list)  # those an answer may call (tool_choice "none": none)
    forced_call: dict | None = None  # the constraint of tool_choice "required" or a named tool (tools.py)
    chat_echo: str = ""  # chat with vLLM's echo: the last (assistant) message, which the answer continues
