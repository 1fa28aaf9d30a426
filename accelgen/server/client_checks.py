"""Drive a running accelgen server through the `openai` client and LangChain (`langchain-openai`), as users do, and
check that speculation changes nothing: every call must succeed, structured output must validate against its
schema, and each method's output must equal the same request's with method autoregressive (greedy, or sampled
with a seed). scripts/openai_clients.py runs these against a server it starts; tests/server runs them on a tiny
model. Needs `pip install openai langchain-openai`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable, Literal

import jsonschema
from pydantic import BaseModel, Field

BASELINE = "autoregressive"
QUESTION = [{"role": "user", "content": "Is Paris the capital of France? Answer briefly."}]
PROMPT = "The three primary colours are"
LOGPROB_TOLERANCE = 1e-3  # the same tokens' logprobs from a batched forward and from one alone differ in rounding
STRUCTURED_MAX_TOKENS = 64  # JSON answers (structured output, tool calls) must close: they get at least this many


class Verdict(BaseModel):
    """Whether the statement is true, and how sure the model is (0-9)."""

    answer: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=9)


VERDICT_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                                   "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["answer", "confidence"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def get_weather(city: Literal["Paris", "Oslo", "Lima"], unit: Literal["celsius", "fahrenheit"]) -> str:
    """The current weather in a city.

    Args:
        city: the city.
        unit: the temperature unit.
    """
    return f"sunny in {city}"


@dataclass
class Clients:
    """What a check talks to the server with, for one method."""

    openai: object  # openai.OpenAI
    chat_model: Callable[..., object]  # (**ChatOpenAI arguments) -> a LangChain ChatOpenAI for this method
    model: str
    method: str

    @property
    def extra(self) -> dict:
        return {"extra_body": {"method": self.method}}


# --- the checks: each returns the output that must not depend on the method -------------------------------


def openai_chat(c: Clients, max_tokens: int):
    reply = c.openai.chat.completions.create(model=c.model, messages=QUESTION, max_tokens=max_tokens, temperature=0,
                                             **c.extra)
    return reply.choices[0].message.content


def openai_completion(c: Clients, max_tokens: int):
    reply = c.openai.completions.create(model=c.model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, **c.extra)
    return reply.choices[0].text


def openai_chat_stream(c: Clients, max_tokens: int):
    stream = c.openai.chat.completions.create(model=c.model, messages=QUESTION, max_tokens=max_tokens, temperature=0,
                                              stream=True, stream_options={"include_usage": True}, **c.extra)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def openai_completion_stream(c: Clients, max_tokens: int):
    stream = c.openai.completions.create(model=c.model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                         stream=True, **c.extra)
    return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def openai_n2_seeded(c: Clients, max_tokens: int):
    reply = c.openai.chat.completions.create(model=c.model, messages=QUESTION, max_tokens=max_tokens, temperature=0.8,
                                             n=2, seed=7, **c.extra)
    if len(reply.choices) != 2:
        raise AssertionError(f"asked for n=2, got {len(reply.choices)} choices")
    return [choice.message.content for choice in sorted(reply.choices, key=lambda choice: choice.index)]


def openai_logprobs(c: Clients, max_tokens: int):
    reply = c.openai.chat.completions.create(model=c.model, messages=QUESTION, max_tokens=max_tokens, temperature=0,
                                             logprobs=True, top_logprobs=3, **c.extra)
    content = reply.choices[0].logprobs.content
    if len(content) != reply.usage.completion_tokens:
        raise AssertionError(f"{len(content)} logprobs for {reply.usage.completion_tokens} tokens")
    return [[entry.token, entry.logprob, [[top.token, top.logprob] for top in entry.top_logprobs]] for entry in content]


def openai_json_schema(c: Clients, max_tokens: int):
    max_tokens = max(max_tokens, STRUCTURED_MAX_TOKENS)
    reply = c.openai.chat.completions.create(
        model=c.model, messages=QUESTION, max_tokens=max_tokens, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT_SCHEMA,
                                                                "strict": True}}, **c.extra)
    value = json.loads(reply.choices[0].message.content)
    jsonschema.validate(value, VERDICT_SCHEMA)
    return value


def openai_tools(c: Clients, max_tokens: int):
    max_tokens = max(max_tokens, STRUCTURED_MAX_TOKENS)
    reply = c.openai.chat.completions.create(model=c.model, messages=WEATHER_QUESTION, max_tokens=max_tokens,
                                             temperature=0, tools=[WEATHER_TOOL], tool_choice="required", **c.extra)
    choice = reply.choices[0]
    if choice.finish_reason != "tool_calls" or not choice.message.tool_calls:
        raise AssertionError(f"no tool call (finish_reason {choice.finish_reason!r}): {choice.message.content!r}")
    call = choice.message.tool_calls[0].function
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    return [call.name, arguments]


def langchain_chat(c: Clients, max_tokens: int):
    return c.chat_model(max_tokens=max_tokens).invoke(QUESTION).content


def langchain_stream(c: Clients, max_tokens: int):
    return "".join(chunk.content for chunk in c.chat_model(max_tokens=max_tokens).stream(QUESTION))


def langchain_structured_output(c: Clients, max_tokens: int):
    max_tokens = max(max_tokens, STRUCTURED_MAX_TOKENS)
    structured = c.chat_model(max_tokens=max_tokens).with_structured_output(Verdict, method="json_schema", strict=True)
    verdict = structured.invoke(QUESTION)
    jsonschema.validate(verdict.model_dump(), VERDICT_SCHEMA)
    return verdict.model_dump()


def langchain_bind_tools(c: Clients, max_tokens: int):
    max_tokens = max(max_tokens, STRUCTURED_MAX_TOKENS)
    message = c.chat_model(max_tokens=max_tokens).bind_tools([get_weather], tool_choice="required").invoke(WEATHER_QUESTION)
    if not message.tool_calls:
        raise AssertionError(f"no tool call: {message.content!r}")
    call = message.tool_calls[0]
    jsonschema.validate(call["args"], WEATHER_TOOL["function"]["parameters"])
    return [call["name"], call["args"]]


CHECKS: dict[str, Callable[[Clients, int], object]] = {
    "openai chat": openai_chat, "openai completion": openai_completion, "openai chat stream": openai_chat_stream,
    "openai completion stream": openai_completion_stream, "openai n=2 seeded sampling": openai_n2_seeded,
    "openai logprobs": openai_logprobs, "openai response_format json_schema": openai_json_schema,
    "openai tools": openai_tools, "langchain chat": langchain_chat, "langchain stream": langchain_stream,
    "langchain with_structured_output": langchain_structured_output, "langchain bind_tools": langchain_bind_tools,
}


def same(output, expected) -> bool:
    """Equal, floats within LOGPROB_TOLERANCE."""
    if isinstance(output, float) or isinstance(expected, float):
        return isinstance(output, (int, float)) and math.isclose(output, expected, abs_tol=LOGPROB_TOLERANCE)
    if isinstance(output, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(output) == len(expected) and all(same(a, b) for a, b in zip(output, expected))
    if isinstance(output, dict) and isinstance(expected, dict):
        return output.keys() == expected.keys() and all(same(output[key], expected[key]) for key in output)
    return output == expected


def clients_for(base_url: str, model: str, method: str, api_key: str = "unused") -> Clients:
    import openai
    from langchain_openai import ChatOpenAI

    def chat_model(**arguments):
        return ChatOpenAI(base_url=base_url, api_key=api_key, model=model, temperature=0, max_retries=0,
                          extra_body={"method": method}, **arguments)

    return Clients(openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0), chat_model, model, method)


def run_checks(base_url: str, model: str, methods: list[str], max_tokens: int = 48, api_key: str = "unused",
               checks: dict[str, Callable] = CHECKS, progress: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """Every check with the baseline (autoregressive) and with each method: a row per (check, method) with
    ok (the call succeeded, its output validated and equals the baseline's), the outputs, and the error if any."""
    rows = []
    for name, check in checks.items():
        try:
            expected, baseline_error = check(clients_for(base_url, model, BASELINE, api_key), max_tokens), None
        except Exception as error:  # a failed call is a result to report, not a crash of the run
            expected, baseline_error = None, f"{type(error).__name__}: {error}"
        for method in methods:
            row = {"check": name, "method": method, "expected": expected, "output": None, "error": baseline_error}
            if baseline_error is None:
                try:
                    row["output"] = check(clients_for(base_url, model, method, api_key), max_tokens)
                    if not same(row["output"], expected):
                        row["error"] = "output differs from method autoregressive"
                except Exception as error:
                    row["error"] = f"{type(error).__name__}: {error}"
            row["ok"] = row["error"] is None
            rows.append(row)
            progress(row)
    return rows


def report_markdown(rows: list[dict], server: str) -> str:
    methods = list(dict.fromkeys(row["method"] for row in rows))
    checks = list(dict.fromkeys(row["check"] for row in rows))
    lines = ["# The openai client and LangChain against accelgen", "",
             f"Server: `{server}`. Each call with each method must succeed, validate where it returns JSON, and give "
             f"the same output as method {BASELINE} (greedy, or sampled with a seed).", "",
             f"| check | {BASELINE}'s output | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    by_key = {(row["check"], row["method"]): row for row in rows}
    for check in checks:
        cells = ["identical" if by_key[check, m]["ok"] else f"**failed**: {by_key[check, m]['error']}" for m in methods]
        lines.append(f"| {check} | {table_cell(by_key[check, methods[0]]['expected'])} | " + " | ".join(cells) + " |")
    passed = sum(row["ok"] for row in rows)
    lines += ["", f"{passed} of {len(rows)} passed."]
    return "\n".join(lines) + "\n"


def table_cell(value, limit: int = 80) -> str:
    """A value as short JSON for a Markdown table cell."""
    text = json.dumps(value, ensure_ascii=False)
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return "`" + text.replace("|", "\\|") + "`"
