"""The OpenAI-compatible HTTP API over the engine: /v1/models, /v1/completions, /v1/chat/completions, /metrics.

Requests choose a method with the extra body field `method` (default: the one the server was started
with); method options are the operator's (`-o` on the command line), never the client's, so a request
can name no file (a datastore, references) and no model to load. Errors use OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field

from accelgen.drafters.online import OnlineLearner
from accelgen.generate import Chunk, GenerationResult, Sequence
from accelgen.registry import get_method
from accelgen.server.engine import Engine, Request


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
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # what a torch generator takes
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    # OpenAI fields accepted at their neutral values only (clients often send them); anything else is refused
    presence_penalty: float = Field(default=0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, allow_inf_nan=False)
    logit_bias: dict | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    method: str | None = None  # accelgen's extra field: the generation method


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # other part types are refused by name (message_text)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)  # other OpenAI message fields (name, tool_call_id) are ignored

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)


def create_app(config: ServerConfig, engine: Engine | None = None) -> FastAPI:
    """The FastAPI app; starts its own engine thread (stopped gracefully at shutdown) unless one is given."""
    engine = engine or Engine()
    methods = dict(config.methods) or {config.method: {}}
    if config.method not in methods:
        methods[config.method] = {}
    for method in methods:
        spec = get_method(method)  # unknown names fail at startup, not per request
        if "draft_model" in spec.needs and config.draft_model is None:
            raise ValueError(f"method {method!r} needs a draft model: pass --draft")
        methods[method] = spec.check_options(methods[method])
    if "online" in methods and methods["online"]["learner"] is None:
        # one learner for the server's life, so that the draft learns from every request (drafters/online.py);
        # binding it now refuses a draft that cannot train (not float32) at startup
        learner = OnlineLearner()
        learner.bind(config.draft_model, methods["online"]["train_layers"])
        methods["online"]["learner"] = learner

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop, config.shutdown_grace_seconds)  # no-op after run()'s shutdown

    app = FastAPI(title="accelgen", lifespan=lifespan)
    app.state.engine = engine
    app.state.config = config
    app.state.admission = admission = Admission(config.max_concurrent)

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

    app.add_middleware(Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       body_timeout_seconds=config.body_timeout_seconds)

    @app.get("/health")
    async def health():
        if not engine.ready.is_set():  # still timing forwards for its speculation policy
            return JSONResponse({"status": "starting"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0, "owned_by": "accelgen",
                                            "methods": sorted(methods)}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        return await serve(body, prompt, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: HTTPRequest):
        if getattr(config.tokenizer, "chat_template", None) is None:
            raise APIError(400, f"{config.model_name} has no chat template: use /v1/completions")
        messages = [{"role": m.role, "content": message_text(m.content)} for m in body.messages]
        return await serve(body, messages, http, chat=True)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine, config.model_name), media_type="text/plain; version=0.0.4")

    async def serve(body: _Body, prompt, http: HTTPRequest, chat: bool):
        if body.model is not None and body.model != config.model_name:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves {config.model_name!r}",
                           param="model")
        if body.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        for name, value in body:
            if name in UNSUPPORTED_UNLESS_NEUTRAL and value not in UNSUPPORTED_UNLESS_NEUTRAL[name]:
                raise APIError(400, f"{name}={value!r} is not supported", param=name)
        method = body.method or config.method
        if method not in methods:
            raise APIError(400, f"method {method!r} is not available; choose from {', '.join(sorted(methods))}",
                           param="method")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = config.max_tokens if max_tokens is None else max_tokens
        if max_tokens > config.max_tokens:
            raise APIError(400, f"max_tokens {max_tokens} is over this server's limit of {config.max_tokens}",
                           param="max_tokens")
        stop = check_stop(body.stop)
        if prompt == "" or prompt == []:
            raise APIError(400, "empty prompt", param="prompt")
        # a slot is taken here, before any work, atomically (checking the engine's load instead let a burst
        # through while its requests were being prepared); the engine gives it back when it answers
        if not admission.take():
            raise APIError(429, f"server busy: {config.max_concurrent} requests in flight, try again later",
                           "rate_limit_error")
        try:
            request, events, reply = await submit(body, prompt, method, max_tokens, stop, chat)
        except BaseException:  # refused before the engine had it
            admission.give_back()
            raise
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(stream_events(request, events, reply, include_usage), media_type="text/event-stream")
        return JSONResponse(await collect(request, events, reply, http))

    async def submit(body: _Body, prompt, method: str, max_tokens: int, stop: list[str], chat: bool):
        """Prepare the sequence and hand it to the engine: (request, its event queue, the reply shaper)."""
        def start() -> Sequence:
            with engine.lock:  # the tokenizer and shared drafter state are the engine's while it steps
                sequence = Sequence.start(config.model, config.tokenizer, prompt, method=method,
                                          draft_model=config.draft_model, max_new_tokens=max_tokens,
                                          temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                                          stop=stop, **methods[method])
                if sequence.prompt_tokens > config.max_prompt_tokens:
                    sequence.finish()
                    raise APIError(400, f"prompt has {sequence.prompt_tokens} tokens, over this server's limit of "
                                        f"{config.max_prompt_tokens}", param="prompt")
                return sequence

        try:
            sequence = await asyncio.to_thread(start)
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error)) from None
        except TemplateError as error:  # the chat template refused the conversation (e.g. the order of roles)
            raise APIError(400, f"the chat template refused these messages: {error}", param="messages") from None
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(event) -> None:  # on the engine thread
            if not isinstance(event, Chunk):  # the result or an error: the engine is done with the request
                admission.give_back()
            loop.call_soon_threadsafe(events.put_nowait, event)

        request = Request(sequence, emit, method)
        try:
            engine.submit(request)
        except RuntimeError as error:
            raise APIError(503, str(error), "server_error") from None
        return request, events, Reply(config.model_name, method, chat, sequence.prompt_tokens)

    return app


UNSUPPORTED_UNLESS_NEUTRAL = {  # field -> the values that mean "not used"
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": (None, {}), "logprobs": (None, False, 0),
    "top_logprobs": (None, 0), "echo": (False,), "best_of": (None, 1), "suffix": (None, ""),
}


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
    """Slots for the requests in flight (being prepared, waiting or running): taken and given back under a lock,
    on the event loop's thread and the engine's."""

    def __init__(self, limit: int):
        self.limit, self.taken = limit, 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.taken >= self.limit:
                return False
            self.taken += 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self.taken -= 1


class Reply:
    """Shapes engine events into OpenAI's completion / chat.completion objects and their stream chunks."""

    def __init__(self, model_name: str, method: str, chat: bool, prompt_tokens: int):
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model_name, self.method, self.chat, self.prompt_tokens = model_name, method, chat, prompt_tokens

    def _envelope(self, object_name: str, choice: dict) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model_name,
                "choices": [choice]}

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
            return self._envelope("chat.completion.chunk", {"index": 0, "delta": delta, "finish_reason": finish_reason})
        return self._envelope("text_completion", {"index": 0, "text": text, "finish_reason": finish_reason,
                                                  "logprobs": None})

    def usage_chunk(self, result: GenerationResult) -> dict:
        """The last stream chunk when the client asked for usage (stream_options.include_usage)."""
        return self.chunk("") | {"choices": [], "usage": self.usage(result)}

    def final(self, result: GenerationResult) -> dict:
        finish_reason = openai_finish_reason(result.finish_reason)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": result.text, "finish_reason": finish_reason, "logprobs": None}
        return self._envelope("chat.completion" if self.chat else "text_completion", choice) | {"usage": self.usage(result)}

    def usage(self, result: GenerationResult) -> dict:
        stats = result.stats
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(result.token_ids),
                "total_tokens": self.prompt_tokens + len(result.token_ids),
                # accelgen's additions: what speculation did for this request
                "method": self.method, "target_forwards": stats["target_forwards"],
                "draft_tokens": stats["draft_tokens"], "accepted_draft_tokens": stats["accepted_draft_tokens"],
                "mean_accepted_tokens": round(stats["mean_accepted_tokens"], 4),
                "acceptance_rate": round(stats["acceptance_rate"], 4)}


def openai_finish_reason(reason: str) -> str:
    return {"stop": "stop", "length": "length"}.get(reason, "abort")


async def collect(request: Request, events: asyncio.Queue, reply: Reply, http: HTTPRequest) -> dict:
    """Wait for the result, cancelling the sequence if the client goes away meanwhile."""
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    request.cancel()
                    raise APIError(499, "client disconnected") from None
                continue
            if isinstance(event, Exception):
                raise APIError(500, f"generation failed: {event}", "server_error")
            if isinstance(event, GenerationResult):
                return reply.final(event)
    except asyncio.CancelledError:
        request.cancel()
        raise


async def stream_events(request: Request, events: asyncio.Queue, reply: Reply, include_usage: bool):
    """Server-sent events: a chunk per committed text, the finish reason, optionally usage, then [DONE].
    A client that disconnects cancels the generator, which cancels the sequence."""
    try:
        if reply.chat:
            yield sse(reply.chunk("", first=True))
        while True:
            event = await events.get()
            if isinstance(event, Exception):
                yield sse({"error": {"message": f"generation failed: {event}", "type": "server_error"}})
                break
            if isinstance(event, Chunk):
                if event.text:
                    yield sse(reply.chunk(event.text))
                continue
            yield sse(reply.chunk("", openai_finish_reason(event.finish_reason)))
            if include_usage:
                yield sse(reply.usage_chunk(event))
            break
        yield "data: [DONE]\n\n"
    finally:
        request.cancel()  # no-op once finished; frees the sequence when the client left early


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


def resident_bytes() -> int | None:
    """The process's resident memory now (Linux /proc), or None where that is not available."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def prometheus_text(engine: Engine, model_name: str) -> str:
    """The engine's counters in Prometheus' text exposition format."""
    s = engine.stats
    escaped = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # the text format's escapes
    label = f'{{model="{escaped}"}}'
    metrics = [
        ("accelgen_requests_total", "counter", "Requests received.", s.requests),
        ("accelgen_requests_finished_total", "counter", "Requests that finished.", s.finished),
        ("accelgen_requests_aborted_total", "counter", "Requests cancelled (client gone or shutdown).", s.aborted),
        ("accelgen_requests_failed_total", "counter", "Requests that failed with an error.", s.failed),
        ("accelgen_generated_tokens_total", "counter", "Tokens generated.", s.new_tokens),
        ("accelgen_draft_tokens_total", "counter", "Draft tokens proposed.", s.draft_tokens),
        ("accelgen_accepted_draft_tokens_total", "counter", "Draft tokens accepted.", s.accepted_tokens),
        ("accelgen_engine_steps_total", "counter",
         "Engine steps: a batched forward of the decoding sequences, plus one per prompt chunk.", s.forwards),
        ("accelgen_sequence_steps_total", "counter", "Sequence-steps that verified a draft (tau = tokens / these).",
         s.verify_steps),
        ("accelgen_step_seconds_total", "counter", "Seconds spent in engine steps.", round(s.step_seconds, 6)),
        ("accelgen_draft_cap_total", "counter", "Draft caps summed over batched forwards (uncapped steps count 0).",
         s.draft_cap_total),
        ("accelgen_tokens_per_verify_step", "gauge", "Mean tokens committed per sequence-step (tau).",
         round(s.new_tokens / s.verify_steps, 4) if s.verify_steps else 0.0),
        ("accelgen_acceptance_rate", "gauge", "Accepted / proposed draft tokens.",
         round(s.accepted_tokens / s.draft_tokens, 4) if s.draft_tokens else 0.0),
        ("accelgen_queue_length", "gauge", "Requests waiting for a batch slot.", s.queue_length),
        ("accelgen_batch_size", "gauge", "Sequences in the last batched forward.", s.batch_size),
        ("accelgen_draft_cap", "gauge", "Most draft tokens per sequence in the last step (-1: no cap).",
         -1 if s.draft_cap is None else s.draft_cap),
        ("accelgen_step_seconds_mean", "gauge", "Mean seconds per engine step.",
         round(s.step_seconds / s.forwards, 6) if s.forwards else 0.0),
    ]
    resident = resident_bytes()
    if resident is not None:
        metrics.append(("accelgen_process_resident_bytes", "gauge", "Resident memory of the server process.", resident))
    lines = []
    for name, kind, help_text, value in metrics:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{label} {value}"]
    return "\n".join(lines) + "\n"


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
