"""A server config over the tiny model, and a real uvicorn server on loopback for end-to-end tests."""

import socket
import threading
import time

import pytest
import uvicorn

from accelgen.server.app import ServerConfig, create_app
from accelgen.server.engine import Engine


def server_config(model, tokenizer, **overrides) -> ServerConfig:
    settings = dict(model_name="tiny", model=model, tokenizer=tokenizer, draft_model=model, method="speculative",
                    methods={"speculative": {"gamma": 4}, "pld": {}, "autoregressive": {}}, max_tokens=64,
                    max_prompt_tokens=256)
    return ServerConfig(**(settings | overrides))


@pytest.fixture(scope="session")
def make_server_config():
    return server_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def live_server(tiny_target, tokenizer):
    """A real uvicorn server on loopback, for the openai client and client disconnects."""
    engine = Engine(max_batch=4)
    port = free_port()
    config = server_config(tiny_target, tokenizer, max_tokens=400, body_timeout_seconds=2.0)
    server = uvicorn.Server(uvicorn.Config(create_app(config, engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(timeout=30)


