"""OpenAI tools: the prompt, the call's constraint and its parsing; and tool requests answered with tool_calls,
identical with speculation on and off."""

import copy
import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from accelgen.loop import GenerationResult
from accelgen.server.app import create_app
from accelgen.server.engine import Engine
from accelgen.server.openai_format import Reply
from accelgen.server.schemas import Shape
from accelgen.server.tools import (NamedToolChoice, Tool, call_constraint, call_schema, chosen_tools, parse_tool_call,
                                   render_tool_prompt)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(ADD)]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_the_call_schema_accepts_exactly_a_call_of_one_tool():
    schema = call_schema(TOOLS)
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, schema)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris"}}, schema)
    for wrong in [{"name": "add", "arguments": {"city": "Paris"}}, {"name": "rm", "arguments": {}}, {"name": "add"},
                  {"name": "add", "arguments": {"a": 1, "b": 2}, "extra": 1}]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_tool_choice_decides_the_constraint():
    assert call_constraint(TOOLS, "auto") is None and call_constraint(TOOLS, "none") is None
    assert call_constraint(TOOLS, None) is None
    required = call_constraint(TOOLS, "required")
    assert required["type"] == "json_schema" and required["json_schema"]["schema"] == call_schema(TOOLS)
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "add"}})
    assert call_constraint(TOOLS, named)["json_schema"]["schema"] == call_schema(TOOLS[1:])
    with pytest.raises(ValueError, match="'rm', which is not among the tools"):
        chosen_tools(TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "rm"}}))


@pytest.mark.parametrize("text,call", [
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', {"name": "add", "arguments": {"a": 1, "b": 2}}),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     {"name": "get_weather", "arguments": {"city": "Oslo"}}),
    ('The weather is fine.', None),
    ('{"name": "rm", "arguments": {}}', None),  # not one of the tools
    ('{"name": "add", "arguments": "1, 2"}', None),
    ('<tool_call>{"name": "add", "arguments": {', None),  # cut short
])
def test_parse_tool_call(text, call):
    assert parse_tool_call(text, TOOLS) == call


def test_tools_go_into_the_prompt_by_template_or_system_message(tokenizer):
    text = render_tool_prompt(tokenizer, ASK, TOOLS)  # SmolLM2's template knows no tools: a system message
    assert "<tools>" in text and '"name": "get_weather"' in text and text.endswith("<|im_start|>assistant\n")
    assert text.index("<tools>") < text.index("What is the weather")
    knowing = copy.deepcopy(tokenizer)
    knowing.chat_template = ("{% for tool in tools %}TOOL {{ tool.function.name }}\n{% endfor %}"
                             "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                             "{% for call in m.tool_calls or [] %}CALL {{ call.function.arguments.city }}{% endfor %}"
                             "{{ '\\n' }}{% endfor %}")
    earlier = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert render_tool_prompt(knowing, earlier, TOOLS) == (
        "TOOL get_weather\nTOOL add\nuser: What is the weather in Paris?\nassistant: CALL Paris\ntool: sunny\n")
    plain = render_tool_prompt(tokenizer, earlier, TOOLS)  # the earlier call written as the model would write it
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in plain


@pytest.fixture(scope="module")
def client(tiny_target, tokenizer, make_server_config):
    with TestClient(create_app(make_server_config(tiny_target, tokenizer), Engine(max_batch=4))) as client:
        yield client


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_forced_call_is_returned_as_tool_calls_and_speculation_changes_nothing(client, tool_choice):
    body = {"messages": [{"role": "user", "content": "Add 2 and 3."}], "tools": [WEATHER, ADD],
            "tool_choice": tool_choice, "max_tokens": 64, "temperature": 0}
    replies = {method: client.post("/v1/chat/completions", json=body | {"method": method}).json()
               for method in ("autoregressive", "speculative", "pld")}
    expected = replies["autoregressive"]["choices"][0]
    for method in ("speculative", "pld"):
        choice = replies[method]["choices"][0]
        assert choice["finish_reason"] == expected["finish_reason"]
        if expected["finish_reason"] == "tool_calls":
            assert [c["function"] for c in choice["message"]["tool_calls"]] == \
                [c["function"] for c in expected["message"]["tool_calls"]]
        else:
            assert choice["message"] == expected["message"]
    if expected["finish_reason"] == "tool_calls":
        call = expected["message"]["tool_calls"][0]
        assert expected["message"]["content"] is None and call["type"] == "function" and call["id"].startswith("call_")
        arguments = json.loads(call["function"]["arguments"])
        schema = {"get_weather": WEATHER, "add": ADD}[call["function"]["name"]]["function"]["parameters"]
        jsonschema.validate(arguments, schema)
        if isinstance(tool_choice, dict):
            assert call["function"]["name"] == "add"
    else:  # the random tiny model may not close its JSON within max_tokens
        assert expected["finish_reason"] == "length"


def test_a_streamed_tool_answer_arrives_whole_at_the_end(client):
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 64, "temperature": 0}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    payloads = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    last = payloads[-1]["choices"][0]
    assert last["finish_reason"] == whole["finish_reason"]
    if whole["finish_reason"] == "tool_calls":
        assert last["delta"]["tool_calls"][0]["function"] == whole["message"]["tool_calls"][0]["function"]
        assert last["delta"]["tool_calls"][0]["index"] == 0
    else:
        assert last["delta"]["content"] == whole["message"]["content"]


@pytest.mark.parametrize("body,message", [
    ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "rm"}}}, "'rm', which is not among"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "not both"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tool_requests_get_400(client, body, message):
    response = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4} | body)
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def test_auto_returns_a_call_the_model_wrote_and_text_otherwise():
    shape = Shape(chat=True, described_tools=TOOLS, tools=TOOLS)
    reply = Reply("tiny", "pld", shape, prompt_tokens=5, n=1)
    stats = {"target_forwards": 1, "draft_tokens": 0, "accepted_draft_tokens": 0}
    wrote_call = GenerationResult([1, 2], '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
                                  "stop", stats)
    message, finish_reason = reply.message(wrote_call)
    assert finish_reason == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert reply.message(GenerationResult([1], "It is sunny.", "stop", stats)) == (
        {"role": "assistant", "content": "It is sunny."}, "stop")
    unparsed = Reply("tiny", "pld", Shape(chat=True, described_tools=TOOLS, tools=[]), 5, 1)  # tool_choice "none"
    assert unparsed.message(wrote_call)[1] == "stop"


def test_auto_and_none_answer_with_text_identically_across_methods(client):
    for tool_choice in ("auto", "none"):
        body = {"messages": ASK, "tools": [WEATHER], "tool_choice": tool_choice, "max_tokens": 12, "temperature": 0}
        replies = [client.post("/v1/chat/completions", json=body | {"method": method}).json()["choices"][0]
                   for method in ("autoregressive", "speculative", "pld")]
        assert replies[0] == replies[1] == replies[2]
        assert replies[0]["finish_reason"] == "length" and replies[0]["message"]["content"]  # the tiny model rambles
