"""The OpenAI-compatible API: answers equal `generate`, streams concatenate, limits and bad input get clear 4xx."""

import json
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

import accelgen
from accelgen.server.app import create_app
from accelgen.server.engine import Engine

PROMPT = "def fibonacci(n):"
CHAT = [{"role": "user", "content": "Write a haiku about caches."}]


@pytest.fixture(scope="module")
def client(tiny_target, tokenizer, make_server_config):
    with TestClient(create_app(make_server_config(tiny_target, tokenizer), Engine(max_batch=4))) as client:
        yield client


def sse_payloads(response) -> list:
    lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.mark.parametrize("method", ["speculative", "pld", "autoregressive"])
def test_completion_equals_generate(client, tiny_target, tokenizer, method):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "method": method}
    reply = client.post("/v1/completions", json=body).json()
    alone = accelgen.generate(tiny_target, tokenizer, PROMPT, method=method, draft_model=tiny_target,
                              max_new_tokens=20, gamma=4) if method == "speculative" else \
        accelgen.generate(tiny_target, tokenizer, PROMPT, method=method, max_new_tokens=20)
    assert reply["object"] == "text_completion" and reply["choices"][0]["text"] == alone.text
    assert reply["choices"][0]["finish_reason"] == "length"
    usage = reply["usage"]
    assert usage["completion_tokens"] == 20 and usage["method"] == method
    assert usage["prompt_tokens"] == len(tokenizer(PROMPT).input_ids)
    if method == "speculative":  # the draft is the target itself: all accepted
        assert usage["acceptance_rate"] == 1.0 and usage["mean_accepted_tokens"] > 4


def test_stream_concatenates_to_the_non_stream_text(client):
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json=body | {"stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response)
    assert "".join(p["choices"][0]["text"] for p in payloads if p["choices"]) == whole
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 30


def test_chat_stream_and_non_stream(client, tiny_target, tokenizer):
    body = {"messages": CHAT, "max_tokens": 16, "temperature": 0}
    reply = client.post("/v1/chat/completions", json=body).json()
    alone = accelgen.generate(tiny_target, tokenizer, CHAT, method="speculative", draft_model=tiny_target,
                              max_new_tokens=16, gamma=4)
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"] == {"role": "assistant", "content": alone.text}
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as response:
        payloads = sse_payloads(response)
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(p["choices"][0]["delta"].get("content", "") for p in payloads) == alone.text


def test_concurrent_requests_are_batched_and_each_equals_generate_alone(client, tiny_target, tokenizer):
    prompts = [PROMPT, "import numpy as np\n", "The capital of France", "1, 2, 3, 4,"]
    replies = [None] * len(prompts)

    def ask(i):
        replies[i] = client.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 24, "temperature": 0,
                                                         "method": ["speculative", "pld"][i % 2]}).json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, prompt in enumerate(prompts):
        alone = accelgen.generate(tiny_target, tokenizer, prompt, method="autoregressive", max_new_tokens=24)
        assert replies[i]["choices"][0]["text"] == alone.text


def test_models_and_metrics(client):
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["methods"] == ["autoregressive", "pld", "speculative"]
    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    text = client.get("/metrics").text
    assert "# TYPE accelgen_requests_total counter" in text
    values = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines() if not line.startswith("#")}
    assert values["accelgen_requests_total"] >= 1 and values["accelgen_generated_tokens_total"] >= 4
    assert 0 < values["accelgen_acceptance_rate"] <= 1


@pytest.mark.parametrize("body,status,message", [
    ({"prompt": PROMPT, "method": "warp-drive"}, 400, "method 'warp-drive' is not available; choose from autoregressive, pld, speculative"),
    ({"prompt": PROMPT, "max_tokens": 65}, 400, "over this server's limit of 64"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "is not served here"),
    ({"prompt": PROMPT, "n": 2}, 400, "only n=1"),
    ({"prompt": ""}, 400, "empty prompt"),
    ({"prompt": "word " * 300}, 400, "over this server's limit of 256"),
    ({"prompt": PROMPT, "temperature": 0.7, "method": "pld", "max_tokens": 4}, 200, None),
    ({"max_tokens": 5}, 400, "prompt: Field required"),
    ({"prompt": PROMPT, "datastore": "/etc/passwd"}, 400, "datastore: Extra inputs are not permitted"),
    ({"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ({"prompt": PROMPT, "presence_penalty": 0.5}, 400, "presence_penalty=0.5 is not supported"),
    ({"prompt": [5, 99999999]}, 400, "prompt token id 99999999 is outside the model's vocabulary"),
    ({"prompt": [[5, 6], [7]]}, 400, "only one prompt per request"),
    ({"prompt": PROMPT, "presence_penalty": 0, "logprobs": None, "max_tokens": 2}, 200, None),
])
def test_bad_requests_get_clear_errors(client, body, status, message):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    if message:
        error = response.json()["error"]
        assert message in error["message"] and error["code"] == status


def test_max_tokens_zero_and_token_id_prompts(client, tiny_target, tokenizer):
    empty = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}).json()
    assert empty["choices"][0]["text"] == "" and empty["usage"]["completion_tokens"] == 0
    reply = client.post("/v1/completions", json={"prompt": [5, 17, 923], "max_tokens": 6, "temperature": 0}).json()
    assert reply["choices"][0]["text"] == accelgen.generate(tiny_target, tokenizer, [5, 17, 923], max_new_tokens=6).text


def test_invalid_json_and_missing_length(client):
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    response = client.post("/v1/completions", content=iter([b'{"prompt": "x"}']), headers={"content-type": "application/json"})
    assert response.status_code == 411


def test_limits_api_key_and_busy(tiny_target, tokenizer, make_server_config):
    app = create_app(make_server_config(tiny_target, tokenizer, api_key="s3cret", max_body_bytes=200, max_concurrent=0))
    with TestClient(app) as client:
        body = {"prompt": PROMPT, "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 401
        wrong = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        auth = {"Authorization": "Bearer s3cret"}
        assert client.post("/v1/completions", json={"prompt": "x" * 300}, headers=auth).status_code == 413
        busy = client.post("/v1/completions", json=body, headers=auth)
        assert busy.status_code == 429 and "busy" in busy.json()["error"]["message"]
        assert client.get("/health").status_code == 200  # health needs no key


def test_startup_refuses_unknown_methods_and_missing_draft(tiny_target, tokenizer, make_server_config):
    with pytest.raises(ValueError, match="unknown method"):
        create_app(make_server_config(tiny_target, tokenizer, methods={"warp-drive": {}}))
    with pytest.raises(ValueError, match="needs a draft model"):
        create_app(make_server_config(tiny_target, tokenizer, draft_model=None))
    with pytest.raises(ValueError, match="has no option .gama."):
        create_app(make_server_config(tiny_target, tokenizer, methods={"speculative": {"gama": 3}}))


def test_openai_client_works_unchanged(live_server, tiny_target, tokenizer):
    openai = pytest.importorskip("openai")
    url, _ = live_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    alone = accelgen.generate(tiny_target, tokenizer, CHAT, method="pld", max_new_tokens=12)
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                           extra_body={"method": "pld"})
    assert reply.choices[0].message.content == alone.text and reply.usage.completion_tokens == 12
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                            extra_body={"method": "pld"})
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == alone.text
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
    assert completion.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="not available"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, extra_body={"method": "nope"})


def test_client_disconnect_aborts_the_sequence(live_server):
    url, engine = live_server
    aborted = engine.stats.aborted
    body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True, "method": "autoregressive"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        next(response.iter_lines())  # the first event arrives, then the client hangs up
    deadline = time.monotonic() + 20
    while engine.stats.aborted == aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats.aborted == aborted + 1
    assert engine.load == 0
