"""/openapi.json describes the API: every status code and content type an operation answers, OpenAI's error body,
the limits the server enforces (a body valid by the document is served), /metrics as Prometheus text. A bounded,
derandomized schemathesis run against the document checks it on the server itself."""

import collections
import re
import time
from datetime import timedelta

import jsonschema
import pytest
import schemathesis
import schemathesis.python.asgi
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from accelgen.server.app import create_app
from accelgen.server.engine import Engine
from accelgen.server.openapi import UNSTATED_RULES
from accelgen.server.schemas import ChatBody, CompletionBody

PROMPT = "def f(x):"
MAX_TOKENS = 4  # the server's limit, which the document states: what the fuzzer generates stays cheap
# a model of the tiny shape with a context long enough for the prompts the fuzzer writes (tools, documents)
CONTEXT = 4096


@pytest.fixture(scope="module")
def app(make_tiny_model, tokenizer, make_server_config):
    model = make_tiny_model("qwen2", seed=0, max_positions=CONTEXT)
    return create_app(make_server_config(model, tokenizer, draft_model=model, max_tokens=MAX_TOKENS,
                                         max_prompt_tokens=CONTEXT // 2), Engine(max_batch=4))


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, raise_server_exceptions=False) as client:  # a bug must show as a 500, not raise
        yield client


@pytest.fixture(scope="module")
def document(client):
    return client.get("/openapi.json").json()


def body_validator(document, name: str) -> jsonschema.Draft202012Validator:
    """A validator of the request body `name` (a components schema), its references resolved in the document."""
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}",
                                            "components": document["components"]})


def test_every_operation_documents_its_errors_in_openai_shape(document):
    error = {"$ref": "#/components/schemas/ErrorBody"}
    for path, operations in document["paths"].items():
        for verb, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (verb, path)  # validation fails with 400, in OpenAI's shape
            assert responses["500"]["content"]["application/json"]["schema"] == error
            if path != "/health":  # the one path without the API key
                assert responses["401"]["content"]["application/json"]["schema"] == error
            if verb == "post":
                for status in ("400", "404", "408", "411", "413", "429", "503"):
                    assert responses[status]["content"]["application/json"]["schema"] == error, (path, status)
                assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(document["components"]["schemas"]["ErrorObject"]["required"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_metrics_are_documented_as_the_prometheus_text_they_are(client, document):
    documented = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    served = client.get("/metrics").headers["content-type"]
    assert list(documented) == [served] and served.startswith("text/plain; version=0.0.4")


def test_the_request_schemas_hold_every_accepted_field(document):
    """vLLM's extras among them: a client generated from the document can send what the server takes."""
    for body, model in (("CompletionBody", CompletionBody), ("ChatBody", ChatBody)):
        documented = document["components"]["schemas"][body]["properties"]
        assert set(documented) == set(model.model_fields)
    vllm = {"ignore_eos", "min_tokens", "top_k", "min_p", "repetition_penalty", "skip_special_tokens",
            "include_stop_str_in_output", "spaces_between_special_tokens", "truncate_prompt_tokens", "stop_token_ids",
            "allowed_token_ids", "bad_words", "guided_json", "structured_outputs", "request_id"}
    assert vllm <= set(document["components"]["schemas"]["CompletionBody"]["properties"])


# bodies the server refuses (400) and the document refuses too, and bodies both accept
REFUSED = [
    {"prompt": ""}, {"prompt": []}, {"prompt": [""]}, {"prompt": [[]]}, {"prompt": ["a", "b"]},
    {"prompt": [[5, 6], [7]]}, {"prompt": [5, 99999999]}, {"prompt": PROMPT, "max_tokens": MAX_TOKENS + 1},
    {"prompt": PROMPT, "model": "gpt-4"}, {"prompt": PROMPT, "method": "warp-drive"}, {"prompt": PROMPT, "n": 9},
    {"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, {"prompt": PROMPT, "stop": "z" * 1001},
    {"prompt": PROMPT, "logprobs": 1, "echo": True}, {"prompt": PROMPT, "logit_bias": {"5": 1}},
    {"prompt": PROMPT, "best_of": 2}, {"prompt": PROMPT, "use_beam_search": True}, {"prompt": PROMPT, "priority": 1},
    {"prompt": PROMPT, "response_format": {"type": "yaml"}}, {"prompt": PROMPT, "response_format": {"type": "json_schema"}},
    {"prompt": PROMPT, "truncate_prompt_tokens": 0}, {"prompt": PROMPT, "stop_token_ids": [-1]},
    {"prompt": PROMPT, "allowed_token_ids": []}, {"prompt": PROMPT, "structured_outputs": {"regex": "a+"}},
    {"prompt": PROMPT, "guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
]
SERVED = [
    {"prompt": PROMPT}, {"prompt": [5, 6]}, {"prompt": [PROMPT]}, {"prompt": [[5, 6]]},
    {"prompt": PROMPT, "max_tokens": 2.0, "seed": 3.0}, {"prompt": PROMPT, "logit_bias": {}, "best_of": 1},
    {"prompt": PROMPT, "truncate_prompt_tokens": -1, "ignore_eos": True, "min_tokens": 2, "top_k": -1,
     "max_tokens": 3},
    {"prompt": PROMPT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
]
CHAT = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT_REFUSED = [
    {"messages": []}, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    {"messages": CHAT, "top_logprobs": 2}, {"messages": CHAT, "tool_choice": "required"},
    {"messages": CHAT, "tools": [TOOL], "response_format": {"type": "json_object"}},
    {"messages": CHAT, "tools": [TOOL], "add_generation_prompt": False},
]
CHAT_SERVED = [
    {"messages": CHAT, "logprobs": True, "top_logprobs": 2}, {"messages": CHAT, "tools": [TOOL], "tool_choice": "required"},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "top_logprobs": 0},
    {"messages": CHAT + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "not JSON"}}]}]},
]


@pytest.mark.parametrize("path,name,body,status", [
    *[("/v1/completions", "CompletionBody", body, 400) for body in REFUSED],
    *[("/v1/completions", "CompletionBody", {"max_tokens": 1} | body, 200) for body in SERVED],
    *[("/v1/chat/completions", "ChatBody", body, 400) for body in CHAT_REFUSED],
    *[("/v1/chat/completions", "ChatBody", {"max_tokens": 1} | body, 200) for body in CHAT_SERVED],
])
def test_the_document_refuses_what_the_server_refuses(client, document, path, name, body, status):
    response = client.post(path, json=body)
    valid = body_validator(document, name).is_valid(body)
    # a model the server does not serve is 404, and refused by the document's enum all the same
    assert response.status_code == (404 if body.get("model") == "gpt-4" else status), response.text
    assert valid == (status == 200)


def test_what_the_fuzzer_found_stays_fixed(client, tokenizer):
    # min_p once ran before allowed_token_ids, so it could drop every allowed token: NaN logprobs, a 500
    token = tokenizer(" the", add_special_tokens=False).input_ids[0]
    body = {"prompt": PROMPT, "allowed_token_ids": [token], "min_p": 0.9, "temperature": 0.7, "logprobs": 0,
            "max_tokens": 3, "top_p": 0.05, "frequency_penalty": 0.05}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["logprobs"]["tokens"] == [" the"] * 3
    # no token left at all (EOS alone allowed, and held back): reported as -9999, as a token that cannot be drawn
    eos = tokenizer.eos_token_id
    reply = client.post("/v1/completions", json={"prompt": PROMPT, "allowed_token_ids": [eos], "min_tokens": 2,
                                                 "logprobs": 0, "max_tokens": 2})
    assert reply.status_code == 200 and -9999.0 in reply.json()["choices"][0]["logprobs"]["token_logprobs"]
    # an earlier tool call without its function once raised KeyError: a 500
    bad_call = {"messages": CHAT + [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}]}
    response = client.post("/v1/chat/completions", json=bad_call)
    assert response.status_code == 400 and "function" in response.json()["error"]["message"]


def test_routing_errors_use_openai_shape(client):
    for response, status in ((client.get("/nope"), 404), (client.delete("/v1/completions"), 405)):
        assert response.status_code == status
        assert response.json()["error"]["code"] == status


def test_the_400_description_lists_the_rules_json_schema_cannot_state(document):
    description = document["paths"]["/v1/completions"]["post"]["responses"]["400"]["description"]
    assert all(rule in description for rule in UNSTATED_RULES.values())


# The fuzzer: requests generated from the server's own document, positive (valid by it) and negative (invalid).
EXAMPLES = {"positive": 50, "negative": 20}  # per operation; POSTs generate up to MAX_TOKENS tokens each
CONTEXT_REFUSAL = re.compile(r"prompt has \d+ tokens")  # a prompt's length in tokens: no JSON Schema can count it


@pytest.fixture(scope="module")
def fuzzed_app(make_tiny_model, tokenizer, make_server_config):
    """An app of its own: schemathesis runs its lifespan (the engine) for the rest of the process."""
    model = make_tiny_model("qwen2", seed=0, max_positions=CONTEXT)
    yield create_app(make_server_config(model, tokenizer, draft_model=model, max_tokens=MAX_TOKENS,
                                        max_prompt_tokens=CONTEXT // 2), Engine(max_batch=4))
    schemathesis.python.asgi.shutdown_lifespans()


def test_a_schemathesis_run_finds_the_document_true(fuzzed_app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzzed_app)
    seen, refused, by_unstated_rule = collections.Counter(), [], []
    started = time.monotonic()
    for operation in (result.ok() for result in schema.get_all_operations()):
        for mode, examples in EXAMPLES.items():
            @settings(max_examples=examples, derandomize=True, database=None, deadline=timedelta(seconds=20),
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
            def run(case):
                response = case.call()  # in-process, through the ASGI app (a bug raises here)
                seen[(case.method, response.status_code)] += 1
                # no 5xx; status, content type and body as documented
                case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                         content_type_conformance, response_schema_conformance])
                if mode == "positive" and response.status_code in (400, 422):  # valid by the document: served
                    error = response.json()["error"]
                    unstated = error["param"] in UNSTATED_RULES or CONTEXT_REFUSAL.match(error["message"])
                    (by_unstated_rule if unstated else refused).append((case.body, error["message"]))

            if operation.method.upper() == "POST" or mode == "positive":  # a GET takes no body to get wrong
                run()
    statuses = collections.Counter()
    for (_, status), count in seen.items():
        statuses[status] += count
    print(f"schemathesis: {sum(seen.values())} requests in {time.monotonic() - started:.0f} s, "
          f"statuses {dict(sorted(statuses.items()))}; valid ones refused by a rule the schema cannot state: "
          f"{[message for _, message in by_unstated_rule]}")
    assert not refused, refused[:3]
    served = sum(count for (method, status), count in seen.items() if method == "POST" and status == 200)
    assert served >= EXAMPLES["positive"]  # valid requests were generated for, not refused
