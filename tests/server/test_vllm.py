"""vLLM's extra request parameters: each honoured as vLLM documents it, streamed and not, on both endpoints; what
has no counterpart refused by name (400, OpenAI's error shape); served-model-name aliases; CORS."""

import json

import pytest
from fastapi.testclient import TestClient

import accelgen
from accelgen.server.app import create_app
from accelgen.server.engine import Engine

PROMPT = "def fibonacci(n):"
CHAT = [{"role": "user", "content": "Write a haiku about caches."}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(tiny_target, tokenizer, make_server_config):
    config = make_server_config(tiny_target, tokenizer, aliases=("alias-a", "alias-b"))
    with TestClient(create_app(config, Engine(max_batch=4))) as client:
        yield client


def answer(client, body: dict, stream: bool, chat: bool = False) -> dict:
    """{text, finish_reason, tokens, id} of one choice, read from the whole reply or from its stream."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = body | ({"messages": CHAT} if chat and "messages" not in body else {})
    body = body | ({} if chat or "prompt" in body else {"prompt": PROMPT})
    if not stream:
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
        reply = response.json()
        choice = reply["choices"][0]
        return {"text": choice["message"]["content"] if chat else choice["text"], "id": reply["id"],
                "finish_reason": choice["finish_reason"], "tokens": reply["usage"]["completion_tokens"],
                "prompt_tokens": reply["usage"]["prompt_tokens"]}
    with client.stream("POST", path, json=body | {"stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    choices = [p["choices"][0] for p in payloads if p["choices"]]
    texts = [c["delta"].get("content") or "" if chat else c["text"] for c in choices]
    usage = payloads[-1]["usage"]
    return {"text": "".join(texts), "finish_reason": choices[-1]["finish_reason"], "id": payloads[0]["id"],
            "tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"]}


@pytest.fixture(scope="module")
def eos(tokenizer):
    return tokenizer.eos_token_id


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_ignore_eos_generates_to_max_tokens_past_eos(client, eos, stream, chat):
    only_eos = {"max_tokens": 6, "temperature": 0, "allowed_token_ids": [eos]}  # EOS is the only token it may draw
    stopped = answer(client, only_eos, stream, chat)
    assert stopped["finish_reason"] == "stop" and stopped["tokens"] == 1
    ignored = answer(client, only_eos | {"ignore_eos": True}, stream, chat)
    assert ignored["finish_reason"] == "length" and ignored["tokens"] == 6


@pytest.fixture(scope="module")
def eos_first_rival(client, eos):
    """A token the model, allowed only it and EOS, ranks below EOS: greedy decoding then stops at once."""
    for token in range(100, 400):
        reply = answer(client, {"max_tokens": 6, "temperature": 0, "allowed_token_ids": [eos, token]}, False)
        if reply["tokens"] == 1 and reply["finish_reason"] == "stop":
            return token
    pytest.fail("no token ranked below EOS")


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_eos_back(client, eos, eos_first_rival, tokenizer, stream, chat):
    # (in chat the prompt differs, so EOS need not come first there: the hold is what is checked)
    body = {"max_tokens": 8, "temperature": 0, "allowed_token_ids": [eos, eos_first_rival], "min_tokens": 4}
    held = answer(client, body, stream, chat)
    assert held["tokens"] >= 4
    assert held["text"].startswith(tokenizer.decode([eos_first_rival]) * 4)


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_stop_strings_and_stop_token_ids_back(client, tokenizer, stream):
    greedy = answer(client, {"max_tokens": 16, "temperature": 0}, False)["text"]
    stop = greedy[2:5]  # found within the first tokens
    cut = answer(client, {"max_tokens": 16, "temperature": 0, "stop": [stop]}, stream)
    assert cut["finish_reason"] == "stop" and cut["text"] == greedy[: greedy.index(stop)]
    held = answer(client, {"max_tokens": 16, "temperature": 0, "stop": [stop], "min_tokens": 10}, stream)
    assert held["tokens"] >= 10 and len(held["text"]) > len(cut["text"]) and greedy.startswith(held["text"])
    first = tokenizer(PROMPT + greedy).input_ids[len(tokenizer(PROMPT).input_ids)]
    by_token = answer(client, {"max_tokens": 16, "temperature": 0, "stop_token_ids": [first]}, stream)
    assert by_token == by_token | {"finish_reason": "stop", "tokens": 1, "text": ""}  # vLLM leaves its text out
    assert answer(client, {"max_tokens": 16, "temperature": 0, "stop_token_ids": [first], "min_tokens": 5},
                  stream)["tokens"] >= 5


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(client, stream, chat):
    greedy = answer(client, {"max_tokens": 16, "temperature": 0}, False, chat)["text"]
    stop = greedy[3:6]
    kept = answer(client, {"max_tokens": 16, "temperature": 0, "stop": stop, "include_stop_str_in_output": True},
                  stream, chat)
    assert kept["finish_reason"] == "stop" and kept["text"] == greedy[: greedy.index(stop) + len(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens_false_keeps_their_text(client, tokenizer, eos, stream):
    body = {"max_tokens": 3, "temperature": 0, "allowed_token_ids": [eos], "ignore_eos": True}
    assert answer(client, body, stream)["text"] == ""  # vLLM's default skips them
    kept = answer(client, body | {"skip_special_tokens": False, "spaces_between_special_tokens": False}, stream)
    assert kept["text"] == tokenizer.eos_token * 3


@pytest.mark.parametrize("stream", [False, True])
def test_sampling_extras_equal_generate(client, tiny_target, tokenizer, stream):
    greedy = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=12).text
    assert answer(client, {"max_tokens": 12, "temperature": 0, "top_k": -1}, stream)["text"] == greedy
    # min_p 1 keeps only the most likely token: sampling at any temperature is greedy decoding
    assert answer(client, {"max_tokens": 12, "temperature": 1.5, "seed": 3, "min_p": 1.0}, stream)["text"] == greedy
    penalised = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=12, repetition_penalty=1.5).text
    assert answer(client, {"max_tokens": 12, "temperature": 0, "repetition_penalty": 1.5}, stream)["text"] == penalised
    first_word = greedy.split()[0]
    banned = answer(client, {"max_tokens": 12, "temperature": 0, "bad_words": [first_word]}, stream)["text"]
    assert not banned.startswith(greedy[: greedy.index(first_word) + len(first_word)])


@pytest.mark.parametrize("stream", [False, True])
def test_truncate_prompt_tokens_keeps_the_last_tokens(client, tiny_target, tokenizer, stream):
    ids = tokenizer(PROMPT).input_ids
    reply = answer(client, {"max_tokens": 8, "temperature": 0, "truncate_prompt_tokens": 3}, stream)
    assert reply["prompt_tokens"] == 3
    assert reply["text"] == accelgen.generate(tiny_target, tokenizer, ids[-3:], max_new_tokens=8).text
    assert answer(client, {"max_tokens": 2, "truncate_prompt_tokens": -1}, stream)["prompt_tokens"] == len(ids)


def test_request_id_guided_json_and_add_special_tokens(client, tokenizer):
    assert answer(client, {"max_tokens": 2, "request_id": "abc"}, False)["id"] == "cmpl-abc"
    body = {"messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 30, "temperature": 0}
    constrained = {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": SCHEMA}}
    by_format = client.post("/v1/chat/completions", json=body | {"response_format": constrained}).json()
    by_guided = client.post("/v1/chat/completions", json=body | {"guided_json": SCHEMA}).json()
    assert by_guided["choices"][0]["message"] == by_format["choices"][0]["message"]
    plain = answer(client, {"max_tokens": 1, "add_special_tokens": False}, False)["prompt_tokens"]
    assert plain == len(tokenizer(PROMPT, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_template_options(client, tokenizer, stream):
    def rendered_length(messages, **options):
        return len(tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, **options),
                             add_special_tokens=False).input_ids)

    assert answer(client, {"max_tokens": 2, "add_generation_prompt": False}, stream, chat=True)["prompt_tokens"] == \
        rendered_length(CHAT, add_generation_prompt=False)
    started = CHAT + [{"role": "assistant", "content": "Caches"}]
    body = {"messages": started, "max_tokens": 4, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True, "echo": True}
    reply = answer(client, body, stream, chat=True)
    assert reply["prompt_tokens"] == rendered_length(started, continue_final_message=True)
    assert reply["text"].startswith("Caches")  # echo: the answer continues the assistant's message
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    assert answer(client, {"max_tokens": 2, "chat_template": template}, stream, chat=True)["prompt_tokens"] == \
        len(tokenizer(CHAT[0]["content"] + "\n", add_special_tokens=False).input_ids)


@pytest.mark.parametrize("field, value, reason", [
    ("use_beam_search", True, "beam search is not implemented"),
    ("priority", 1, "arrival order"),
    ("guided_regex", "a+", "JSON schema only"),
    ("prompt_logprobs", 1, "no logprobs"),
    ("logits_processors", ["my.module:Processor"], "may not name code"),
    ("truncate_prompt_tokens", 10_000, "over this server's prompt limit"),
    ("min_tokens", 100, "over max_tokens"),
    ("allowed_token_ids", [10**9], "not a token id of this model"),
])
def test_what_has_no_counterpart_is_refused_by_name(client, field, value, reason):
    response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, field: value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert field in error["message"] and reason in error["message"] and error["type"] == "invalid_request_error"


def test_unknown_fields_still_fail_but_vllm_neutral_ones_pass(client):
    unknown = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "ignore_eoss": True})
    assert unknown.status_code == 400 and "ignore_eoss" in unknown.json()["error"]["message"]
    neutral = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0, "cache_salt": "s",
               "guided_decoding_backend": "xgrammar", "truncation_side": "left", "vllm_xargs": {}}
    assert client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2} | neutral).status_code == 200


def test_served_model_names_are_accepted_and_listed(client):
    listed = [card["id"] for card in client.get("/v1/models").json()["data"]]
    assert listed == ["tiny", "alias-a", "alias-b"]
    reply = client.post("/v1/completions", json={"model": "alias-b", "prompt": PROMPT, "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["model"] == "tiny"  # vLLM's: the first name
    assert client.get("/v1/models/alias-a").json()["id"] == "alias-a"
    missing = client.post("/v1/completions", json={"model": "other", "prompt": PROMPT, "max_tokens": 2})
    assert missing.status_code == 404 and "'alias-a'" in missing.json()["error"]["message"]


def test_cors_headers_with_allowed_origins(tiny_target, tokenizer, make_server_config):
    config = make_server_config(tiny_target, tokenizer, allowed_origins=("https://app.example",), api_key="k")
    with TestClient(create_app(config, Engine(max_batch=1))) as client:
        origin = {"Origin": "https://app.example"}
        preflight = client.options("/v1/chat/completions", headers=origin | {
            "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
        assert preflight.status_code == 200  # no API key on a preflight
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        listed = client.get("/v1/models", headers=origin | {"Authorization": "Bearer k"})
        assert listed.headers["access-control-allow-origin"] == "https://app.example"
        other = client.get("/v1/models", headers={"Origin": "https://evil.example", "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in other.headers
    with TestClient(create_app(make_server_config(tiny_target, tokenizer), Engine(max_batch=1))) as plain:
        assert "access-control-allow-origin" not in plain.get("/v1/models", headers=origin).headers
