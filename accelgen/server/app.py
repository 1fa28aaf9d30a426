"""The OpenAI-compatible HTTP API over the engine: /v1/models, /v1/completions, /v1/chat/completions, /metrics.

Requests choose a method with the extra body field `method` (default: the one the server was started
with); method options are the operator's (`-o` on the command line), never the client's, so a request
can name no file (a datastore, references) and no model to load. Errors use OpenAI's error shape.

A request with n > 1 runs n sequences in the batch, choice i seeded with seed + i. Every sampling field
(temperature, top_p, top_k, penalties, seed, response_format, tools) applies to the target and the drafts
alike, so that speculation never changes the output (docs/server.md). accelgen's statistics of a reply are in
its top-level field "accelgen"; `usage` is OpenAI's.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

import jsonschema
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field

from accelgen.generate import Chunk, GenerationResult, Sequence
from accelgen.registry import get_method
from accelgen.server.engine import Engine, Request
from accelgen.server.metrics import CONTENT_TYPE, Metrics
from accelgen.server.tools import (Tool, ToolChoice, call_constraint, chosen_tools, openai_tool_calls,
                                   parse_tool_call, render_tool_prompt)
from accelgen.train.online import OnlineLearner


@dataclass
class ServerConfig:
    model_name: str
    model: object
    tokenizer: object
    draft_model: object | None = None
    method: str = "autoregressive"
    methods: dict[str, dict] = field(default_factory=dict)  # method -> operator's options; the methods requests may use
    api_key: str | None = None
    max_prompt_tokens: int = 4096
    max_tokens: int = 1024  # largest max_tokens a request may ask for
    max_body_bytes: int = 1 << 20
    max_concurrent: int = 64  # requests waiting or running; more get 429
    shutdown_grace_seconds: float = 30.0  # in-flight requests may finish within it; then they are aborted
    body_timeout_seconds: float = 10.0  # a POST body must arrive within it (408 otherwise)

    def __post_init__(self):
        if self.api_key == "":
            raise ValueError("an empty API key would turn authentication off: to serve without a key, give none")


# OpenAI allows 4 stop sequences. The matcher costs time linear in their length (stopping.py), but a stop
# string is text the server keeps and scans for the request's whole life, and nothing a client means by
# "stop here" is longer than a few lines: 1,000 characters is far beyond any real use, and bounds the work.
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 1000
MAX_N = 8  # choices per request: each is a sequence in the batch
MAX_TOP_LOGPROBS = 20  # OpenAI's limits: 20 alternatives per token in chat, 5 in completions
MAX_COMPLETION_LOGPROBS = 5


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


class _Body(BaseModel):
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
    top_k: int = Field(default=0, ge=0)  # an extension (as vLLM's): 0 keeps every token
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    response_format: dict | None = None
    # OpenAI fields accepted at their neutral values only (clients often send them); anything else is refused
    logit_bias: dict | None = None
    method: str | None = None  # accelgen's extra field: the generation method


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)  # alternatives per token
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # other part types are refused by name (message_text)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)  # other OpenAI message fields (name, refusal) are ignored

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; an answer makes at most one call


def create_app(config: ServerConfig, engine: Engine | None = None) -> FastAPI:
    """The FastAPI app; starts its own engine thread (stopped gracefully at shutdown) unless one is given."""
    engine = engine or Engine(device=getattr(config.model, "device", None))
    service = Service(config, engine, served_methods(config), Admission(config.max_concurrent),
                      Metrics(engine, config.model_name))

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop, config.shutdown_grace_seconds)  # no-op after run()'s shutdown

    app = FastAPI(title="accelgen", lifespan=lifespan)
    app.state.engine = engine
    app.state.config = config
    app.state.admission = service.admission
    app.state.metrics = service.metrics
    add_error_handlers(app)
    app.add_middleware(Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       body_timeout_seconds=config.body_timeout_seconds)
    add_model_routes(app, service)
    add_completion_routes(app, service)

    @app.get("/metrics")
    async def metrics_text():
        return Response(service.metrics.text(), media_type=CONTENT_TYPE)

    return app


def served_methods(config: ServerConfig) -> dict[str, dict]:
    """The methods the server serves, each with its checked options: unknown names, a missing draft model and bad
    options fail at startup, not per request."""
    methods = dict(config.methods) or {config.method: {}}
    if config.method not in methods:
        methods[config.method] = {}
    for method in methods:
        spec = get_method(method)
        spec.check_needs(draft_model=config.draft_model, how="--draft")
        methods[method] = spec.check_options(methods[method])
    if "online" in methods and methods["online"]["learner"] is None:
        # one learner for the server's life, so that the draft learns from every request (drafters/online.py);
        # binding it now refuses a draft that cannot train (not float32) at startup
        learner = OnlineLearner()
        learner.bind(config.draft_model, methods["online"]["train_layers"])
        methods["online"]["learner"] = learner
    return methods


def add_error_handlers(app: FastAPI) -> None:
    """Every error answered in OpenAI's shape: ours, a body that fails validation, and a bug."""

    @app.exception_handler(APIError)
    async def api_error(_request, error: APIError):
        return error_response(error.status, error.message, error.kind, error.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, error: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in error.errors())
        return error_response(400, f"invalid request: {problems}")

    @app.exception_handler(Exception)
    async def bug(_request, error: Exception):  # still a bug, logged with its traceback; the client gets JSON
        return error_response(500, f"internal error: {type(error).__name__}", "server_error")


def add_model_routes(app: FastAPI, service: Service) -> None:
    """/health, and the model served with its methods."""
    config = service.config

    @app.get("/health")
    async def health():
        if not service.engine.ready.is_set():  # e.g. still timing batched forwards for its speculation policy
            return JSONResponse({"status": "starting", "detail": service.engine.starting}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [service.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != config.model_name:
            raise APIError(404, f"model {model_id!r} does not exist here; this server serves {config.model_name!r}",
                           param="model")
        return service.model_card()


def add_completion_routes(app: FastAPI, service: Service) -> None:
    """/v1/completions and /v1/chat/completions: each checks what is its own, then the service serves it."""

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest):
        prompt = completion_prompt(body)
        return await service.serve(body, prompt, http, Shape(chat=False, logprobs=body.logprobs, echo=body.echo))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: HTTPRequest):
        messages, shape = chat_request(body, service.config)
        return await service.serve(body, messages, http, shape)


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


@dataclass
class Service:
    """What the routes share: the configuration, the engine, the methods served with their options, the admission
    of requests in flight and the metrics. `serve` answers a checked request."""

    config: ServerConfig
    engine: Engine
    methods: dict[str, dict]
    admission: Admission
    metrics: Metrics

    def model_card(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "accelgen",
                "methods": sorted(self.methods)}

    async def serve(self, body: _Body, prompt, http: HTTPRequest, shape: Shape):
        arrived = time.monotonic()  # for the latency histograms
        method, options = self.checked(body, prompt, shape)
        # slots are taken here, one per choice, before any work, atomically (checking the engine's load instead let
        # a burst through while its requests were being prepared); the engine gives each back when it answers
        if not self.admission.take(body.n):
            raise APIError(429, f"server busy: {self.config.max_concurrent} requests in flight, try again later",
                           "rate_limit_error")
        try:
            requests, events, reply = await self.submit(prompt, method, options, body.n, body.seed, shape, arrived)
        except BaseException:  # refused before the engine had them
            self.admission.give_back(body.n)
            raise
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(stream_events(requests, events, reply, include_usage), media_type="text/event-stream")
        return JSONResponse(await collect(requests, events, reply, http))

    def checked(self, body: _Body, prompt, shape: Shape) -> tuple[str, dict]:
        """(the method, Sequence.start's sampling arguments) of a request this server can serve, else APIError."""
        config = self.config
        if body.model is not None and body.model != config.model_name:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves {config.model_name!r}",
                           param="model")
        for name, value in body:
            if name in UNSUPPORTED_UNLESS_NEUTRAL and value not in UNSUPPORTED_UNLESS_NEUTRAL[name]:
                raise APIError(400, f"{name}={value!r} is not supported", param=name)
        method = body.method or config.method
        if method not in self.methods:
            raise APIError(400, f"method {method!r} is not available; choose from {', '.join(sorted(self.methods))}",
                           param="method")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = config.max_tokens if max_tokens is None else max_tokens
        if max_tokens > config.max_tokens:
            raise APIError(400, f"max_tokens {max_tokens} is over this server's limit of {config.max_tokens}",
                           param="max_tokens")
        stop = check_stop(body.stop)
        if prompt == "" or prompt == []:
            raise APIError(400, "empty prompt", param="prompt")
        return method, sampling_options(body, shape, max_tokens, stop)

    async def submit(self, prompt, method: str, options: dict, n: int, seed: int | None, shape: Shape, arrived: float):
        """Prepare the n sequences and hand them to the engine: (requests, their event queue, the reply shaper)."""
        try:
            sequences, echo = await asyncio.to_thread(self.start_sequences, prompt, method, options, n, seed, shape)
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error)) from None
        except TemplateError as error:  # the chat template refused the conversation (e.g. the order of roles)
            raise APIError(400, f"the chat template refused these messages: {error}", param="messages") from None
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        reply = Reply(self.config.model_name, method, shape, sequences[0].prompt_tokens, n, echo)
        requests = [Request(sequence, self.emitter(events, loop, arrived, i), method)
                    for i, sequence in enumerate(sequences)]
        try:
            self.engine.submit(*requests)
        except RuntimeError as error:
            with self.engine.lock:
                for sequence in sequences:
                    sequence.finish()
            raise APIError(503, str(error), "server_error") from None
        return requests, events, reply

    def start_sequences(self, prompt, method: str, options: dict, n: int, seed: int | None,
                        shape: Shape) -> tuple[list[Sequence], str]:
        """The request's n sequences, choice i seeded with seed + i, and the prompt text to echo ("" if none)."""
        config = self.config
        with self.engine.lock:  # the tokenizer and shared drafter state are the engine's while it steps
            ids = prompt
            if shape.described_tools:  # (tools.py)
                text = render_tool_prompt(config.tokenizer, prompt, shape.described_tools)
                ids = config.tokenizer(text, add_special_tokens=False).input_ids
            sequences = []
            try:
                for i in range(n):
                    sequences.append(Sequence.start(config.model, config.tokenizer, ids, method=method,
                                                    draft_model=config.draft_model,
                                                    seed=None if seed is None else seed + i,
                                                    **options, **self.methods[method]))
                    if sequences[-1].prompt_tokens > config.max_prompt_tokens:
                        raise APIError(400, f"prompt has {sequences[-1].prompt_tokens} tokens, over this server's "
                                            f"limit of {config.max_prompt_tokens}", param="prompt")
            except BaseException:
                for sequence in sequences:
                    sequence.finish()
                raise
            echo = "" if not shape.echo else prompt if isinstance(prompt, str) else config.tokenizer.decode(prompt)
            return sequences, echo

    def emitter(self, events: asyncio.Queue, loop: asyncio.AbstractEventLoop, arrived: float, index: int):
        """The engine's callback for choice `index`: each event to the request's queue, with its logprob entries."""
        first_token = None

        def emit(event) -> None:  # on the engine thread, which holds engine.lock: the tokenizer is free
            nonlocal first_token
            if isinstance(event, Chunk) and event.token_ids and first_token is None:
                first_token = time.monotonic()
            if isinstance(event, GenerationResult):
                self.metrics.observe_request(arrived, first_token, time.monotonic(), len(event.token_ids))
            if not isinstance(event, Chunk):  # the result or an error: the engine is done with the sequence
                self.admission.give_back()
            logprobs = logprob_entries(self.config.tokenizer, None if isinstance(event, Exception) else event.logprobs)
            loop.call_soon_threadsafe(events.put_nowait, (index, event, logprobs))

        return emit


UNSUPPORTED_UNLESS_NEUTRAL = {  # field -> the values that mean "not used"
    "logit_bias": (None, {}), "best_of": (None, 1), "suffix": (None, ""),
}
LOWEST_LOGPROB = -9999.0  # what OpenAI reports for a token that could not be drawn (JSON has no -inf)


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


def sampling_options(body: _Body, shape: Shape, max_tokens: int, stop: list[str]) -> dict:
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


def chat_message(message: ChatMessage) -> dict:
    """A message as chat templates take it."""
    text = message_text(message.content)
    if message.tool_calls is not None:
        return {"role": message.role, "content": text, "tool_calls": message.tool_calls}
    if message.tool_call_id is not None:
        return {"role": message.role, "content": text, "tool_call_id": message.tool_call_id}
    return {"role": message.role, "content": text}


def logprob_entries(tokenizer, logprobs: list | None) -> list[dict] | None:
    """TokenLogprobs (generate.py) in OpenAI's chat form: {token, logprob, bytes, top_logprobs: [...]} per token."""
    if logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": max(float(logprob), LOWEST_LOGPROB), "bytes": list(text.encode())}

    return [entry(item.token_id, item.logprob) | {"top_logprobs": [entry(token, value) for token, value in item.top]}
            for item in logprobs]


def completion_logprobs(entries: list[dict], offset: int) -> dict:
    """Chat-form entries in the completions' (legacy) form; offset: the text's length before the first token."""
    starts = [offset]
    for entry in entries[:-1]:
        starts.append(starts[-1] + len(entry["token"]))
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": starts}


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


class Admission:
    """Slots for the sequences in flight (being prepared, waiting or running): taken and given back under a lock,
    on the event loop's thread and the engine's."""

    def __init__(self, limit: int):
        self.limit, self.taken = limit, 0
        self._lock = threading.Lock()

    def take(self, count: int = 1) -> bool:
        """All count slots, or none."""
        with self._lock:
            if self.taken + count > self.limit:
                return False
            self.taken += count
            return True

    def give_back(self, count: int = 1) -> None:
        with self._lock:
            self.taken -= count


class Reply:
    """Shapes engine events into OpenAI's completion / chat.completion objects and their stream chunks, one choice
    per sequence. Logprobs arrive as chat-form entries (logprob_entries)."""

    def __init__(self, model_name: str, method: str, shape: Shape, prompt_tokens: int, n: int, echo: str = ""):
        self.id = ("chatcmpl-" if shape.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model_name, self.method, self.shape, self.prompt_tokens, self.n = model_name, method, shape, prompt_tokens, n
        self.echo = echo
        self.offsets = [len(echo)] * n  # completions: each choice's text so far (the next token's text_offset)

    @property
    def chat(self) -> bool:
        return self.shape.chat

    @property
    def buffered(self) -> bool:
        """Whether a stream sends each answer whole at its end: with tools, whether it is a call shows only then."""
        return self.chat and bool(self.shape.tools)

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model_name,
                "choices": choices}

    def _logprobs(self, index: int, entries: list[dict] | None, text: str) -> dict | None:
        if entries is None:
            return None
        if self.chat:
            return {"content": entries, "refusal": None}
        shaped = completion_logprobs(entries, self.offsets[index])
        self.offsets[index] += len(text)
        return shaped

    def opening_chunks(self) -> list[dict]:
        """A stream's first chunks: chat announces the role of each choice; an echoed completion sends the prompt."""
        if self.chat:
            return [self._envelope("chat.completion.chunk", [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                              "logprobs": None, "finish_reason": None}])
                    for i in range(self.n)]
        return [self.chunk(i, self.echo) for i in range(self.n)] if self.echo else []

    def chunk(self, index: int, text: str, entries: list[dict] | None = None) -> dict:
        logprobs = self._logprobs(index, entries, text)
        if self.chat:
            return self._envelope("chat.completion.chunk", [{"index": index, "delta": {"content": text},
                                                             "logprobs": logprobs, "finish_reason": None}])
        return self._envelope("text_completion", [{"index": index, "text": text, "finish_reason": None,
                                                   "logprobs": logprobs}])

    def finish_chunk(self, index: int, result: GenerationResult, entries: list[dict] | None) -> dict:
        """The chunk that ends a choice; a buffered answer (tools) comes whole in it."""
        if not self.buffered:
            finish_reason = openai_finish_reason(result.finish_reason)
            if self.chat:
                return self._envelope("chat.completion.chunk", [{"index": index, "delta": {}, "logprobs": None,
                                                                 "finish_reason": finish_reason}])
            return self._envelope("text_completion", [{"index": index, "text": "", "logprobs": None,
                                                       "finish_reason": finish_reason}])
        message, finish_reason = self.message(result)
        delta = {"content": message["content"]} if message["content"] is not None else \
            {"tool_calls": [call | {"index": i} for i, call in enumerate(message["tool_calls"])]}
        return self._envelope("chat.completion.chunk", [{"index": index, "delta": delta, "finish_reason": finish_reason,
                                                         "logprobs": self._logprobs(index, entries, "")}])

    def usage_chunk(self, results: list[GenerationResult]) -> dict:
        """The last stream chunk when the client asked for usage (stream_options.include_usage)."""
        object_name = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(object_name, []) | {"usage": self.usage(results), "accelgen": self.statistics(results)}

    def message(self, result: GenerationResult) -> tuple[dict, str]:
        """A chat answer and its finish reason: a call of one of the tools (tool_calls), or text."""
        call = parse_tool_call(result.text, self.shape.tools) if self.shape.tools else None
        if call is not None:
            return {"role": "assistant", "content": None, "tool_calls": openai_tool_calls(call)}, "tool_calls"
        return {"role": "assistant", "content": result.text}, openai_finish_reason(result.finish_reason)

    def final(self, results: list[GenerationResult], entries: list[list[dict] | None]) -> dict:
        choices = []
        for index, (result, logprobs) in enumerate(zip(results, entries)):
            if self.chat:
                message, finish_reason = self.message(result)
                choices.append({"index": index, "message": message, "finish_reason": finish_reason,
                                "logprobs": self._logprobs(index, logprobs, result.text)})
            else:
                choices.append({"index": index, "text": self.echo + result.text,
                                "finish_reason": openai_finish_reason(result.finish_reason),
                                "logprobs": self._logprobs(index, logprobs, result.text)})
        envelope = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        return envelope | {"usage": self.usage(results), "accelgen": self.statistics(results)}

    def usage(self, results: list[GenerationResult]) -> dict:
        """OpenAI's usage (the prompt counted once, as OpenAI does for n > 1); the draft tokens the target accepted
        and rejected fill completion_tokens_details' accepted and rejected prediction tokens."""
        completion = sum(len(result.token_ids) for result in results)
        drafted = sum(result.stats["draft_tokens"] for result in results)
        accepted = sum(result.stats["accepted_draft_tokens"] for result in results)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": drafted - accepted}}

    def statistics(self, results: list[GenerationResult]) -> dict:
        """The extension field "accelgen": what speculation did for this request (over all its choices)."""
        tokens = sum(len(result.token_ids) for result in results)
        forwards = sum(result.stats["target_forwards"] for result in results)
        drafted = sum(result.stats["draft_tokens"] for result in results)
        accepted = sum(result.stats["accepted_draft_tokens"] for result in results)
        return {"method": self.method, "target_forwards": forwards, "draft_tokens": drafted,
                "accepted_draft_tokens": accepted,
                "mean_accepted_tokens": round(tokens / forwards, 4) if forwards else 0.0,
                "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0}


def openai_finish_reason(reason: str) -> str:
    return {"stop": "stop", "length": "length"}.get(reason, "abort")


def cancel_all(requests: list[Request]) -> None:
    for request in requests:
        request.cancel()  # no-op once finished; frees the sequence when the client left early


async def collect(requests: list[Request], events: asyncio.Queue, reply: Reply, http: HTTPRequest) -> dict:
    """Wait for every choice's result, cancelling the sequences if the client goes away meanwhile."""
    results, entries = [None] * len(requests), [None] * len(requests)
    try:
        while any(result is None for result in results):
            try:
                index, event, logprobs = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    cancel_all(requests)
                    raise APIError(499, "client disconnected") from None
                continue
            if isinstance(event, Exception):
                cancel_all(requests)
                raise APIError(500, f"generation failed: {event}", "server_error")
            if isinstance(event, GenerationResult):
                results[index], entries[index] = event, logprobs
        return reply.final(results, entries)
    except asyncio.CancelledError:
        cancel_all(requests)
        raise


async def stream_events(requests: list[Request], events: asyncio.Queue, reply: Reply, include_usage: bool):
    """Server-sent events: a chunk per committed text of each choice, each choice's finish, optionally usage, then
    [DONE]. A client that disconnects cancels the generator, which cancels the sequences."""
    try:
        for payload in reply.opening_chunks():
            yield sse(payload)
        results: dict[int, GenerationResult] = {}
        failed = False
        while len(results) < len(requests) and not failed:
            index, event, logprobs = await events.get()
            if isinstance(event, Exception):
                yield sse({"error": {"message": f"generation failed: {event}", "type": "server_error"}})
                failed = True
            elif isinstance(event, Chunk):
                if not reply.buffered and (event.text or logprobs):
                    yield sse(reply.chunk(index, event.text, logprobs))
            else:
                results[index] = event
                yield sse(reply.finish_chunk(index, event, logprobs))
        if include_usage and not failed:
            yield sse(reply.usage_chunk([results[i] for i in range(len(requests))]))
        yield "data: [DONE]\n\n"
    finally:
        cancel_all(requests)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


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


class Guard:
    """ASGI middleware before any body parsing: the API key on every path but /health (the API, /metrics and
    the OpenAPI docs alike), then for POST the body: a Content-Length is required, so that an oversized body is
    refused before it is read, and the whole body must arrive within body_timeout_seconds, so that a client
    sending less than it announced cannot hold a connection (uvicorn times out idle connections, not slow bodies)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, body_timeout_seconds: float):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.body_timeout_seconds = body_timeout_seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        refusal = self.refusal(dict(scope["headers"]), scope["method"])
        if refusal is None and scope["method"] == "POST":
            body = await self.read_body(receive)
            if body is None:
                refusal = error_response(408, f"the request body did not arrive within {self.body_timeout_seconds:g} s")
                refusal.headers["connection"] = "close"
            else:
                receive = replay(body, receive)
        if refusal is not None:
            return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

    async def read_body(self, receive) -> bytes | None:
        """The whole body, or None when it did not arrive in time (or the client left)."""
        chunks = []
        try:
            async with asyncio.timeout(self.body_timeout_seconds):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            return None

    def refusal(self, headers: dict[bytes, bytes], method: str) -> JSONResponse | None:
        if self.api_key is not None:
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            # the scheme is case-insensitive (RFC 7235); a key without it is refused
            if scheme.lower() != b"bearer" or not secrets.compare_digest(given.strip(), self.api_key.encode()):
                return error_response(401, "invalid or missing API key (header Authorization: Bearer <key>)",
                                      "authentication_error")
        if method == "POST":
            length = headers.get(b"content-length", b"")
            if not length.isdigit():
                return error_response(411, "a Content-Length header is required")
            if int(length) > self.max_body_bytes:
                return error_response(413, f"request body of {int(length)} bytes is over the limit of {self.max_body_bytes}")
        return None


def replay(body: bytes, receive):
    """An ASGI receive that gives the body already read, then passes on to the client's (disconnects)."""
    given = False

    async def receive_again():
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive_again


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


def run(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Serve app (from create_app) until SIGINT or SIGTERM.

    uvicorn's shutdown waits for the handlers up to its timeout, cancels them (no answer: a plain 500, a cut
    stream), and only then runs the app's lifespan end. So the engine is stopped first instead: requests in
    flight get the grace period to finish, then are aborted and answered (finish_reason "abort", and [DONE] for
    streams) while their handlers still run; uvicorn's own timeout comes after that."""
    import uvicorn

    engine, grace = app.state.engine, app.state.config.shutdown_grace_seconds

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            await asyncio.to_thread(engine.stop, grace)  # new requests meanwhile get 503
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=int(grace) + 10)
    Server(config).run()
