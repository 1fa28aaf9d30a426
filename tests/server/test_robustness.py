"""The server against hostile or careless clients (issue 27, docs/reliability.md): bounded stop strings, exact
admission under a burst, an answer for every request at shutdown, strict input types, no 500 from odd
numbers, the API key, /metrics escaping, and a body that never arrives."""

import copy
import json
import signal
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from accelgen.cli import app as cli_app
from accelgen.server.app import create_app
from accelgen.cli.loadtest import started_server
from accelgen.server.engine import Engine
from accelgen.server.metrics import Metrics
from accelgen.server.schemas import MAX_STOP_CHARS

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def client(tiny_target, tokenizer, make_server_config):
    with TestClient(create_app(make_server_config(tiny_target, tokenizer), Engine(max_batch=4))) as client:
        yield client


def chat(content, role="user") -> dict:
    return {"messages": [{"role": role, "content": content}], "max_tokens": 2}


@pytest.mark.parametrize("path,body,message", [
    ("completions", {"prompt": PROMPT, "max_tokens": "10"}, "max_tokens: Input should be a valid integer"),
    ("completions", {"prompt": PROMPT, "max_tokens": True}, "max_tokens: Input should be a valid integer"),
    ("completions", {"prompt": PROMPT, "max_tokens": 2.5}, "max_tokens: Input should be a valid integer"),
    ("completions", {"prompt": PROMPT, "stream": "yes"}, "stream: Input should be a valid boolean"),
    ("completions", {"prompt": PROMPT, "stream": 1}, "stream: Input should be a valid boolean"),
    ("completions", {"prompt": PROMPT, "temperature": "0.5"}, "temperature: Input should be a valid number"),
    ("completions", {"prompt": PROMPT, "seed": 2**70}, "seed: Input should be less than"),
    ("completions", {"prompt": [5, True]}, "prompt"),
    ("completions", {"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, "stop: at most 4 stop sequences, got 5"),
    ("completions", {"prompt": PROMPT, "stop": "z" * (MAX_STOP_CHARS + 1)}, "stop: a stop sequence of 1001 characters"),
    ("completions", {"prompt": PROMPT, "stop": [1]}, "stop"),
    ("chat/completions", chat("hi", role="wizard"), "messages.0.role: Input should be 'system', 'user', 'assistant' or 'tool'"),
    ("chat/completions", chat([{"type": "text", "text": 123}]), "messages.0.content.list[ContentPart].0.text"),
    ("chat/completions", chat([{"type": "text"}]), "a content part of type 'text' needs a string field 'text'"),
    ("chat/completions", chat([{"type": "image_url", "image_url": {"url": "x"}}]), "of type 'image_url' is not supported"),
])
def test_wrong_types_get_a_400_naming_the_field(client, path, body, message):
    response = client.post(f"/v1/{path}", json=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_stop_strings_at_the_limits_are_served(client):
    body = {"prompt": PROMPT, "max_tokens": 4, "stop": ["z" * MAX_STOP_CHARS] * 4}
    assert client.post("/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize("sampling", [{"temperature": 1e-38}, {"temperature": 1.0, "top_p": 1e-300}])
def test_vanishing_temperature_or_top_p_samples_the_best_token(client, sampling):
    body = {"prompt": PROMPT, "max_tokens": 8, "method": "autoregressive"}
    greedy = client.post("/v1/completions", json=body | {"temperature": 0}).json()["choices"][0]["text"]
    response = client.post("/v1/completions", json=body | sampling | {"seed": 1})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == greedy


def test_a_burst_is_admitted_up_to_max_concurrent_exactly(tiny_target, tokenizer, make_server_config):
    engine = Engine(max_batch=4)
    gate, step = threading.Event(), engine.step
    engine.step = lambda: (gate.wait(), step())  # nothing finishes until every request of the burst has arrived
    app = create_app(make_server_config(tiny_target, tokenizer, max_concurrent=6), engine)
    statuses = []
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    with TestClient(app) as client:
        threads = [threading.Thread(target=lambda: statuses.append(client.post("/v1/completions", json=body).status_code))
                   for _ in range(30)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        while len(statuses) < 24 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        for thread in threads:
            thread.join()
        assert sorted(statuses) == [200] * 6 + [429] * 24
        # every slot came back: after the engine's answers, and after a request refused once admitted
        assert app.state.admission.taken == 0
        assert client.post("/v1/completions", json={"prompt": "word " * 300}).status_code == 400  # too long a prompt
        assert app.state.admission.taken == 0


def metric_values(url: str) -> dict[str, float]:
    return {sample.name: sample.value for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
            for sample in family.samples}


def test_sigterm_answers_every_request_in_flight(make_tiny_model, tokenizer, tmp_path):
    folder = tmp_path / "tiny"
    model = make_tiny_model("qwen2", seed=0, max_positions=4096)
    with torch.no_grad():
        model.lm_head.weight[2] = 0  # EOS's logit 0 is never the greatest: the requests run until the SIGTERM
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    arguments = ["serve", "--model", str(folder), "--method", "autoregressive", "--token-budget", "0",
                 "--max-tokens", "4000", "--shutdown-grace", "1", "--threads", "1", "--log-level", "warning"]
    with started_server(arguments) as (url, _, process):
        body = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0}
        answers = {}

        def stream():
            with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60) as response:
                answers["stream"] = [line for line in response.iter_lines() if line]

        def whole():
            answers["whole"] = httpx.post(f"{url}/v1/completions", json=body, timeout=60)

        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while metric_values(url).get("accelgen:request_received_total", 0) < 2:
            assert time.monotonic() < deadline, "the requests did not reach the engine"
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=60)
        assert process.wait(timeout=30) == -signal.SIGTERM  # uvicorn raises the signal again once it has shut down
    whole_reply = answers["whole"]
    assert whole_reply.status_code == 200, whole_reply.text
    assert whole_reply.json()["choices"][0]["finish_reason"] == "abort"
    assert 0 < whole_reply.json()["usage"]["completion_tokens"] < 4000
    lines = answers["stream"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"


def test_an_empty_api_key_is_refused(tiny_target, tokenizer, make_server_config):
    with pytest.raises(ValueError, match="empty API key would turn authentication off"):
        make_server_config(tiny_target, tokenizer, api_key="")
    result = CliRunner().invoke(cli_app, ["serve", "--api-key", ""])
    assert result.exit_code == 2 and "empty --api-key would turn authentication off" in result.output


def test_the_api_key_guards_everything_but_health(tiny_target, tokenizer, make_server_config):
    with TestClient(create_app(make_server_config(tiny_target, tokenizer, api_key="s3cret"))) as client:
        body = {"prompt": PROMPT, "max_tokens": 1}
        for header in ["Bearer s3cret", "bearer s3cret", "BEARER  s3cret"]:  # the scheme is case-insensitive
            assert client.post("/v1/completions", json=body, headers={"Authorization": header}).status_code == 200
        for header in ["s3cret", "Basic s3cret", "Bearer", "Bearers3cret", "Bearer s3cre", ""]:
            assert client.post("/v1/completions", json=body, headers={"Authorization": header}).status_code == 401
        for path in ["/docs", "/openapi.json", "/metrics", "/v1/models"]:
            assert client.get(path).status_code == 401
            assert client.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert client.get("/health").status_code == 200


def test_metrics_escape_the_model_label():
    name = 'evil"} 1\nfake_metric{a="\\'
    families = list(text_string_to_metric_families(Metrics(Engine(), name).text().decode()))
    assert "fake_metric" not in {family.name for family in families}
    labelled = [sample for family in families for sample in family.samples if "model_name" in sample.labels]
    assert labelled and all(sample.labels["model_name"] == name for sample in labelled)


def test_a_body_shorter_than_its_content_length_is_timed_out(live_server):
    address = urlparse(live_server[0])
    with socket.create_connection((address.hostname, address.port), timeout=15) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')
        started, reply = time.monotonic(), b""
        while chunk := connection.recv(4096):  # until the server closes the connection
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 2 s" in reply
    assert time.monotonic() - started < 10


def test_nan_and_a_refusing_chat_template_get_400(client, tiny_target, tokenizer, make_server_config):
    response = client.post("/v1/completions", content=b'{"prompt": "x", "temperature": NaN}',
                           headers={"content-type": "application/json"})
    assert response.status_code == 400 and "temperature: Input should be a finite number" in response.text
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with TestClient(create_app(make_server_config(tiny_target, strict))) as strict_client:
        response = strict_client.post("/v1/chat/completions", json=chat("hi"))
    assert response.status_code == 400 and "roles must alternate" in response.json()["error"]["message"]
