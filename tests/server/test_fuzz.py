"""A bounded fuzz of the request schema: valid bodies with a few fields set to odd or arbitrary JSON values get a
200 or a 4xx JSON error, never a 500 (capped: 50 examples per endpoint, derandomized, so CI sees the same ones;
the inputs that once gave a 500 are pinned as examples)."""

from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from accelgen.server.app import create_app
from accelgen.server.engine import Engine

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly plausible values, sometimes anything."""
    return st.one_of(valid, valid, json_values)


COMMON = {
    "model": field(st.sampled_from(["tiny", "gpt-4", ""])),
    "max_tokens": field(st.integers(-2, 6)),
    "max_completion_tokens": field(st.integers(-2, 6)),
    "temperature": field(st.floats(-1, 3) | st.sampled_from([0, 1e-38, 2])),
    "top_p": field(st.floats(-0.5, 1.5) | st.sampled_from([1e-300, 1])),
    "stop": field(st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=6)),
    "seed": field(st.integers(-(2**64), 2**64)),
    "n": field(st.integers(0, 2)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "method": field(st.sampled_from(["autoregressive", "pld", "speculative", "warp-drive"])),
    "presence_penalty": field(st.floats(-3, 3)),
    "frequency_penalty": field(st.floats(-3, 3)),
    "top_k": field(st.integers(-2, 60000)),
    # vLLM's extras
    "ignore_eos": field(st.booleans()),
    "min_tokens": field(st.integers(-1, 8)),
    "stop_token_ids": field(st.lists(st.integers(-1, 50000), max_size=3)),
    "allowed_token_ids": field(st.lists(st.integers(-1, 50000), max_size=3)),
    "truncate_prompt_tokens": field(st.integers(-2, 300)),
    "repetition_penalty": field(st.floats(-1, 3)),
    "min_p": field(st.floats(-0.5, 1.5)),
    "bad_words": field(st.lists(st.text(max_size=4), max_size=3)),
    "include_stop_str_in_output": field(st.booleans()),
    "skip_special_tokens": field(st.booleans()),
    "response_format": field(st.sampled_from([
        {"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}, {"type": "xml"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}])),
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}}}}}
MESSAGE = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "user", "assistant", "tool", "wizard"]))},
    optional={"content": field(st.text(max_size=20) | st.lists(st.fixed_dictionaries(
        {"type": field(st.sampled_from(["text", "image_url"]))}, optional={"text": field(st.text(max_size=10))}),
        max_size=3))})


def bodies(base: dict, fields: dict) -> st.SearchStrategy:
    """A valid base body with up to 3 fields set or replaced: most examples get past validation to generation."""
    changes = st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: fields[name] for name in names}))
    return changes.map(lambda change: base | change)


COMPLETION = bodies({"prompt": "def f(x):", "max_tokens": 4}, COMMON | {
    "prompt": field(st.text(max_size=20) | st.lists(st.integers(-1, 60000), max_size=5)),
    "echo": field(st.booleans()), "suffix": field(st.text(max_size=4)), "logprobs": field(st.integers(-1, 6))})
CHAT = bodies({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
              COMMON | {"messages": field(st.lists(MESSAGE, max_size=3)), "logprobs": field(st.booleans()),
                        "top_logprobs": field(st.integers(-1, 21)), "tools": field(st.just([TOOL])),
                        "tool_choice": field(st.sampled_from(["auto", "none", "required", "maybe"])
                                             | st.just({"type": "function", "function": {"name": "f"}}))})
FUZZ = settings(max_examples=50, deadline=timedelta(seconds=10), derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def client(tiny_target, tokenizer, make_server_config):
    app = create_app(make_server_config(tiny_target, tokenizer, max_tokens=6), Engine(max_batch=4))
    with TestClient(app, raise_server_exceptions=False) as client:  # a bug must show as a 500 here, not raise
        yield client


def check(client, path: str, body: dict) -> None:
    response = client.post(path, json=body)
    assert response.status_code == 200 or 400 <= response.status_code < 500, (body, response.status_code, response.text)
    if response.status_code == 200:
        assert ("data: [DONE]" in response.text) if body.get("stream") is True else response.json()["choices"]
    else:
        assert response.json()["error"]["code"] == response.status_code


@FUZZ
@given(body=COMPLETION)
@example(body={"prompt": "x", "temperature": 1e-38})  # once a 500 (issue 27)
@example(body={"prompt": "x", "top_p": 1e-300})
def test_completions_never_answer_500(client, body):
    check(client, "/v1/completions", body)


@FUZZ
@given(body=CHAT)
@example(body={"messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]})  # once a 500
def test_chat_completions_never_answer_500(client, body):
    check(client, "/v1/chat/completions", body)
