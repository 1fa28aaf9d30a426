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
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from accelgen.server.config import ServerConfig
from accelgen.server.engine import Engine
from accelgen.server.errors import APIError, add_error_handlers
from accelgen.server.metrics import CONTENT_TYPE, Metrics
from accelgen.server.middleware import Guard
from accelgen.server.openapi import (HEALTH_RESPONSES, METRICS_RESPONSE, POST_ERRORS, ModelCard, ModelList,
                                     error_responses, install, streamed)
from accelgen.server.request_checks import chat_request, completion_prompt
from accelgen.server.schemas import ChatBody, CompletionBody, Shape
from accelgen.server.service import Admission, Service, served_methods


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
    if config.allowed_origins:  # added last, so outermost: a browser's preflight needs no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    add_model_routes(app, service)
    add_completion_routes(app, service)
    install(app, config, list(service.methods))

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSE | error_responses(401, 500))
    async def metrics_text():
        return Response(service.metrics.text(), media_type=CONTENT_TYPE)

    return app


def add_model_routes(app: FastAPI, service: Service) -> None:
    """/health, and the model served with its methods."""
    config = service.config

    @app.get("/health", responses=HEALTH_RESPONSES | error_responses(500))
    async def health():
        if not service.engine.ready.is_set():  # e.g. still timing batched forwards for its speculation policy
            return JSONResponse({"status": "starting", "detail": service.engine.starting}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}} | error_responses(401, 500))
    async def models():
        return {"object": "list", "data": [service.model_card(name) for name in config.served_names]}

    @app.get("/v1/models/{model_id:path}", response_model=None,
             responses={200: {"model": ModelCard}} | error_responses(401, 404, 500))
    async def model(model_id: str):
        if model_id not in config.served_names:
            raise APIError(404, f"model {model_id!r} does not exist here; this server serves "
                                f"{', '.join(map(repr, config.served_names))}", param="model")
        return service.model_card(model_id)


def add_completion_routes(app: FastAPI, service: Service) -> None:
    """/v1/completions and /v1/chat/completions: each checks what is its own, then the service serves it."""

    @app.post("/v1/completions", responses=streamed("A text_completion, or its chunks when streamed")
              | error_responses(*POST_ERRORS))
    async def completions(body: CompletionBody, http: HTTPRequest):
        prompt = completion_prompt(body)
        return await service.serve(body, prompt, http, Shape(chat=False, logprobs=body.logprobs, echo=body.echo))

    @app.post("/v1/chat/completions", responses=streamed("A chat.completion, or its chunks when streamed")
              | error_responses(*POST_ERRORS))
    async def chat_completions(body: ChatBody, http: HTTPRequest):
        messages, shape = chat_request(body, service.config)
        return await service.serve(body, messages, http, shape)


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
