"""The OpenAI-compatible API: answers equal `generate`, streams concatenate, limits and bad input get clear 4xx."""

import json
import threading
import time

import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient

import accelgen
from accelgen.server.app import create_app
from accelgen.server.engine import Engine
from accelgen.server.speculation import ForwardCosts, Goodput

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
    usage, statistics = reply["usage"], reply["accelgen"]
    assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens", "completion_tokens_details"}
    assert usage["completion_tokens"] == 20 and statistics["method"] == method
    assert usage["prompt_tokens"] == len(tokenizer(PROMPT).input_ids) and usage["total_tokens"] == usage["prompt_tokens"] + 20
    details = usage["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] == statistics["accepted_draft_tokens"]
    assert details["rejected_prediction_tokens"] == statistics["draft_tokens"] - statistics["accepted_draft_tokens"]
    if method == "speculative":  # the draft is the target itself: all accepted
        assert statistics["acceptance_rate"] == 1.0 and statistics["mean_accepted_tokens"] > 4
        assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] == 0


def test_stream_concatenates_to_the_non_stream_text(client):
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json=body | {"stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response)
    assert "".join(p["choices"][0]["text"] for p in payloads if p["choices"]) == whole
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 30
    assert payloads[-1]["accelgen"]["method"] == "speculative"


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


def test_models(client):
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["methods"] == ["autoregressive", "pld", "speculative"]
    assert client.get("/v1/models/tiny").json() == models["data"][0]
    unknown = client.get("/v1/models/org/gpt-4")
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {"message": "model 'org/gpt-4' does not exist here; this server serves 'tiny'",
                                       "type": "invalid_request_error", "param": "model", "code": 404}


@pytest.mark.parametrize("body,status,message", [
    ({"prompt": PROMPT, "method": "warp-drive"}, 400, "method 'warp-drive' is not available; choose from autoregressive, pld, speculative"),
    ({"prompt": PROMPT, "max_tokens": 65}, 400, "over this server's limit of 64"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "is not served here"),
    ({"prompt": PROMPT, "n": 9}, 400, "n: Input should be less than or equal to 8"),
    ({"prompt": PROMPT, "n": 0}, 400, "n: Input should be greater than or equal to 1"),
    ({"prompt": ""}, 400, "empty prompt"),
    ({"prompt": "word " * 300}, 400, "over this server's limit of 256"),
    ({"prompt": PROMPT, "temperature": 0.7, "method": "pld", "max_tokens": 4}, 200, None),
    ({"max_tokens": 5}, 400, "prompt: Field required"),
    ({"prompt": PROMPT, "datastore": "/etc/passwd"}, 400, "datastore: Extra inputs are not permitted"),
    ({"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ({"prompt": PROMPT, "presence_penalty": 2.5}, 400, "presence_penalty: Input should be less than or equal to 2"),
    ({"prompt": PROMPT, "top_k": -2}, 400, "top_k: Input should be greater than or equal to -1"),  # -1: vLLM's off
    ({"prompt": PROMPT, "logprobs": 6}, 400, "logprobs: Input should be less than or equal to 5"),
    ({"prompt": PROMPT, "logprobs": 1, "echo": True}, 400, "echo with logprobs is not supported"),
    ({"prompt": PROMPT, "logit_bias": {"5": 1}}, 400, "logit_bias={'5': 1} is not supported"),
    ({"prompt": PROMPT, "response_format": {"type": "yaml"}}, 400, "response_format type 'yaml' is not supported"),
    ({"prompt": PROMPT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     400, "not a valid JSON schema"),
    ({"prompt": PROMPT, "response_format": {"type": "json_schema"}}, 400, "needs \"json_schema\""),
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


def tokens_of(reply: dict) -> list[str]:
    return [entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]]


def test_n_choices_are_seeded_seed_plus_index(client, tiny_target, tokenizer):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 3, "method": "speculative"}
    reply = client.post("/v1/completions", json=body).json()
    texts = [choice["text"] for choice in sorted(reply["choices"], key=lambda choice: choice["index"])]
    alone = [accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=8, temperature=1.0, seed=5 + i).text
             for i in range(3)]
    assert texts == alone and len(set(texts)) == 3
    assert reply["usage"]["completion_tokens"] == 24 and reply["usage"]["prompt_tokens"] == len(tokenizer(PROMPT).input_ids)
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
        payloads = sse_payloads(response)
    streamed = ["".join(p["choices"][0]["text"] for p in payloads if p["choices"][0]["index"] == i) for i in range(3)]
    assert streamed == alone
    assert sorted(p["choices"][0]["index"] for p in payloads if p["choices"][0]["finish_reason"]) == [0, 1, 2]


def test_chat_logprobs_are_the_targets_and_stream_alike(client):
    body = {"messages": CHAT, "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    replies = {method: client.post("/v1/chat/completions", json=body | {"method": method}).json()
               for method in ("autoregressive", "speculative", "pld")}
    plain = replies["autoregressive"]["choices"][0]["logprobs"]["content"]
    assert len(plain) == 10
    for entry in plain:  # greedy: the chosen token is the best alternative
        assert len(entry["top_logprobs"]) == 3 and entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])
        assert entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] <= 0
    for method in ("speculative", "pld"):
        other = replies[method]["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in other] == [e["token"] for e in plain]
        assert [e["logprob"] for e in other] == pytest.approx([e["logprob"] for e in plain], abs=1e-4)
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as response:
        payloads = sse_payloads(response)
    streamed = [e for p in payloads if p["choices"] and p["choices"][0]["logprobs"] for e in p["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in plain]
    without = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}).json()
    assert without["choices"][0]["logprobs"] is None


def test_completion_logprobs_legacy_form_and_echo(client, tokenizer):
    reply = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2}).json()
    choice = reply["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 6
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(value)
               for top, value in zip(logprobs["top_logprobs"], logprobs["token_logprobs"]))
    assert logprobs["text_offset"][0] == 0
    assert all(b - a == len(token) for a, b, token in zip(logprobs["text_offset"], logprobs["text_offset"][1:], logprobs["tokens"]))
    echoed = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True}).json()
    assert echoed["choices"][0]["text"] == PROMPT + choice["text"]
    ids = tokenizer(PROMPT).input_ids
    by_ids = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0, "echo": True}).json()
    assert by_ids["choices"][0]["text"] == tokenizer.decode(ids) + choice["text"]
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True,
                                                        "stream": True}) as response:
        payloads = sse_payloads(response)
    assert payloads[0]["choices"][0]["text"] == PROMPT
    assert "".join(p["choices"][0]["text"] for p in payloads) == echoed["choices"][0]["text"]


def test_top_k_and_penalties_equal_generate_alone(client, tiny_target, tokenizer):
    sampled = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.8, "top_k": 5, "seed": 11}
    alone = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=10, temperature=0.8, top_k=5, seed=11)
    for method in ("speculative", "pld"):
        reply = client.post("/v1/completions", json=sampled | {"method": method}).json()
        assert reply["choices"][0]["text"] == alone.text
    penalised = {"prompt": "1, 2, 1, 2, 1, 2,", "max_tokens": 32, "temperature": 0, "presence_penalty": 2.0,
                 "frequency_penalty": 2.0}
    alone = accelgen.generate(tiny_target, tokenizer, penalised["prompt"], max_new_tokens=32, presence_penalty=2.0,
                              frequency_penalty=2.0)
    plain = accelgen.generate(tiny_target, tokenizer, penalised["prompt"], max_new_tokens=32)
    assert alone.token_ids != plain.token_ids  # the penalties matter here
    for method in ("speculative", "pld", "autoregressive"):
        assert client.post("/v1/completions", json=penalised | {"method": method}).json()["choices"][0]["text"] == alone.text


SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "count"], "additionalProperties": False}


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}},
    {"type": "json_object"},
])
def test_response_format_is_valid_json_and_speculation_changes_nothing(client, response_format):
    body = {"messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 40, "temperature": 0,
            "response_format": response_format}
    replies = {method: client.post("/v1/chat/completions", json=body | {"method": method}).json()["choices"][0]
               for method in ("autoregressive", "speculative", "pld")}
    assert replies["speculative"] == replies["autoregressive"] == replies["pld"]
    if replies["autoregressive"]["finish_reason"] == "stop" or response_format["type"] == "json_schema":
        assert replies["autoregressive"]["finish_reason"] == "stop"
        value = json.loads(replies["autoregressive"]["message"]["content"])
        if response_format["type"] == "json_schema":
            jsonschema.validate(value, SCHEMA)


@pytest.mark.parametrize("method", ["speculative", "pld"])
def test_a_seeded_request_gives_the_same_tokens_alone_and_under_load(client, method):
    """The draft length follows the batch (TokenBudget(8): 7 tokens alone, 1 beside three others), and seeded
    sampling draws per position, so the tokens do not change."""
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "method": method,
            "logprobs": 0}
    alone = client.post("/v1/completions", json=body).json()
    engine = client.app.state.engine
    replies = [None] * 4
    loads = [{"prompt": prompt, "max_tokens": 64, "temperature": 0.7, "method": "speculative"}
             for prompt in ("import numpy as np\n", "The capital of France", "1, 2, 3, 4,")]

    def ask(i):
        replies[i] = client.post("/v1/completions", json=loads[i] if i < 3 else body).json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads[:3]:
        thread.start()
    deadline = time.monotonic() + 30
    while engine.stats.running < 3:  # the load is in the batch when the seeded request arrives
        assert time.monotonic() < deadline
        time.sleep(0.001)
    threads[3].start()
    for thread in threads:
        thread.join()
    loaded = replies[3]
    assert loaded["choices"][0]["text"] == alone["choices"][0]["text"]
    assert loaded["choices"][0]["logprobs"]["tokens"] == alone["choices"][0]["logprobs"]["tokens"]
    # a seeded request runs as if it were alone: the same drafts, so the same target forwards
    assert loaded["accelgen"]["target_forwards"] == alone["accelgen"]["target_forwards"]


def test_health_says_why_it_is_not_ready_yet(tiny_target, tokenizer, make_server_config):
    timing, release = threading.Event(), threading.Event()

    def calibration(report):  # as policy_calibration reports, held until the test lets it finish
        report("timing batched forwards: 3/8")
        timing.set()
        release.wait(30)
        return ForwardCosts({1: {1: 0.01}}), None

    engine = Engine(speculation=Goodput(calibration=calibration))
    with TestClient(create_app(make_server_config(tiny_target, tokenizer), engine)) as client:
        assert timing.wait(30)
        starting = client.get("/health")
        assert starting.status_code == 503
        assert starting.json() == {"status": "starting", "detail": "timing batched forwards: 3/8"}
        release.set()
        assert engine.ready.wait(30)
        assert client.get("/health").json() == {"status": "ok"}
