"""Serving a checked request: the methods served with their options, the admission of requests in flight, the
request's sequences handed to the engine, and the answer collected whole or streamed."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError

from accelgen.loop import Chunk, GenerationResult, Sequence
from accelgen.registry import get_method
from accelgen.server.config import ServerConfig
from accelgen.server.engine import Engine, Request
from accelgen.server.errors import APIError
from accelgen.server.metrics import Metrics
from accelgen.server.openai_format import Reply, logprob_entries, sse
from accelgen.server.request_checks import PromptText, check_neutral, check_stop, prompt_ids, prompt_text, sampling_options
from accelgen.server.schemas import RequestBody, Shape
from accelgen.server.tools import render_tool_prompt
from accelgen.train.online import OnlineLearner


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
        # one learner for the server's life, so that the draft learns from every request (train/online.py);
        # binding it now refuses a draft that cannot train (not float32) at startup
        learner = OnlineLearner()
        learner.bind(config.draft_model, methods["online"]["train_layers"])
        methods["online"]["learner"] = learner
    return methods


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


@dataclass
class Service:
    """What the routes share: the configuration, the engine, the methods served with their options, the admission
    of requests in flight and the metrics. `serve` answers a checked request."""

    config: ServerConfig
    engine: Engine
    methods: dict[str, dict]
    admission: Admission
    metrics: Metrics

    def model_card(self, name: str | None = None) -> dict:
        """The card of the model under one of its served names (default: the first)."""
        return {"id": name or self.config.model_name, "object": "model", "created": 0, "owned_by": "accelgen",
                "methods": sorted(self.methods)}

    async def serve(self, body: RequestBody, prompt, http: HTTPRequest, shape: Shape):
        arrived = time.monotonic()  # for the latency histograms
        method, options, text = self.checked(body, prompt, shape)
        # slots are taken here, one per choice, before any work, atomically (checking the engine's load instead let
        # a burst through while its requests were being prepared); the engine gives each back when it answers
        if not self.admission.take(body.n):
            raise APIError(429, f"server busy: {self.config.max_concurrent} requests in flight, try again later",
                           "rate_limit_error")
        try:
            requests, events, reply = await self.submit(prompt, method, options, body.n, body.seed, shape, arrived,
                                                        text)
        except BaseException:  # refused before the engine had them
            self.admission.give_back(body.n)
            raise
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(stream_events(requests, events, reply, include_usage), media_type="text/event-stream")
        return JSONResponse(await collect(requests, events, reply, http))

    def checked(self, body: RequestBody, prompt, shape: Shape) -> tuple[str, dict, PromptText]:
        """(the method, Sequence.start's sampling arguments, how the prompt is read) of a request this server can
        serve, else APIError."""
        config = self.config
        if body.model is not None and body.model not in config.served_names:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves "
                                f"{', '.join(map(repr, config.served_names))}", param="model")
        check_neutral(body)
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
        return method, sampling_options(body, shape, max_tokens, stop, config), prompt_text(body, config)

    async def submit(self, prompt, method: str, options: dict, n: int, seed: int | None, shape: Shape, arrived: float,
                     text: PromptText | None = None):
        """Prepare the n sequences and hand them to the engine: (requests, their event queue, the reply shaper)."""
        text = text or PromptText()
        try:
            sequences, echo = await asyncio.to_thread(self.start_sequences, prompt, method, options, n, seed, shape,
                                                      text)
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error)) from None
        except TemplateError as error:  # the chat template refused the conversation (e.g. the order of roles)
            raise APIError(400, f"the chat template refused these messages: {error}", param="messages") from None
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        reply = Reply(self.config.model_name, method, shape, sequences[0].prompt_tokens, n, echo)
        if text.request_id:  # vLLM's: the reply's id names the client's request
            reply.id = ("chatcmpl-" if shape.chat else "cmpl-") + text.request_id
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
                        shape: Shape, text: PromptText | None = None) -> tuple[list[Sequence], str]:
        """The request's n sequences, choice i seeded with seed + i, and the prompt text to echo ("" if none)."""
        config = self.config
        with self.engine.lock:  # the tokenizer and shared drafter state are the engine's while it steps
            ids = prompt
            if shape.described_tools:  # (tools.py)
                rendered = render_tool_prompt(config.tokenizer, prompt, shape.described_tools)
                ids = config.tokenizer(rendered, add_special_tokens=False).input_ids
            ids = prompt_ids(config.tokenizer, ids, text or PromptText())
            sequences = []
            try:
                for i in range(n):
                    sequences.append(Sequence.start(config.model, config.tokenizer, ids, method=method,
                                                    draft_model=config.draft_model,
                                                    seed=None if seed is None else seed + i,
                                                    **options, **self.methods[method]))
                    if text is not None and text.output:
                        sequences[-1].output.set_text_options(**text.output)
                    if sequences[-1].prompt_tokens > config.max_prompt_tokens:
                        raise APIError(400, f"prompt has {sequences[-1].prompt_tokens} tokens, over this server's "
                                            f"limit of {config.max_prompt_tokens}", param="prompt")
            except BaseException:
                for sequence in sequences:
                    sequence.finish()
                raise
            if shape.chat:
                echo = shape.chat_echo
            else:
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
