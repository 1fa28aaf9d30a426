"""OpenAI function tools for chat: the tools into the prompt, the grammar constraint of a call, the call parsed back.

- The prompt: the tokenizer's chat template renders the tools (its `tools=` argument) where it knows them; a
  template that does not (SmolLM2's) gets them in a system message instead, in the Hermes format many models
  were tuned on (`<tools>…</tools>`, a call answered as `<tool_call>{"name": …, "arguments": {…}}</tool_call>`).
- tool_choice "required" or a named function: the answer is constrained (response_format json_schema, applied to
  the target and the drafts alike, so speculation keeps it exact) to one JSON object
  {"name": <a tool's name>, "arguments": <that tool's parameters>}.
- tool_choice "auto" (the default when tools are given): generated without a constraint; an answer that is a
  call, alone or wrapped in <tool_call> tags, is returned as a tool call, anything else as text.
- tool_choice "none": the tools are shown, the answer is text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TOOL_CALL_TAGS = re.compile(r"^\s*<tool_call>\s*(.*?)\s*(?:</tool_call>)?\s*$", re.DOTALL)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call an assistant message made earlier in the conversation (OpenAI's form)."""

    model_config = ConfigDict(strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


def chosen_tools(tools: list[Tool], tool_choice: ToolChoice | None) -> list[Tool]:
    """The tools a call may name under tool_choice (all of them, or the named one); ValueError for an unknown name."""
    if isinstance(tool_choice, NamedToolChoice):
        named = [tool for tool in tools if tool.function.name == tool_choice.function.name]
        if not named:
            raise ValueError(f"tool_choice names {tool_choice.function.name!r}, which is not among the tools")
        return named
    return tools


def call_schema(tools: list[Tool]) -> dict:
    """The JSON schema of one call of one of these tools: {"name": its name, "arguments": its parameters}."""
    def one(tool: Tool) -> dict:
        return {"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                                 "arguments": tool.function.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}

    schemas = [one(tool) for tool in tools]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def call_constraint(tools: list[Tool], tool_choice: ToolChoice | None) -> dict | None:
    """The response_format that forces a call ("required" or a named tool), or None (auto, none: free text)."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    return {"type": "json_schema",
            "json_schema": {"name": "tool_call", "schema": call_schema(chosen_tools(tools, tool_choice)), "strict": True}}


def template_knows_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def render_tool_prompt(tokenizer, messages: list[dict], tools: list[Tool]) -> str:
    """The chat prompt text with the tools described: by the chat template where it renders `tools`, else in a
    system message (Hermes format); earlier calls in the conversation are written as the model would write them."""
    functions = [tool.model_dump(exclude_none=True) for tool in tools]
    if template_knows_tools(tokenizer):
        return tokenizer.apply_chat_template([template_message(m) for m in messages], tools=functions,
                                             tokenize=False, add_generation_prompt=True)
    description = ("You may call one of these functions. Function signatures within <tools></tools> XML tags:\n"
                   f"<tools>\n{chr(10).join(json.dumps(f) for f in functions)}\n</tools>\n"
                   "To call one, answer with a JSON object within <tool_call></tool_call> XML tags:\n"
                   '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    plain = [{"role": m["role"], "content": written_call(m)} for m in messages]
    if plain[0]["role"] == "system":
        plain[0] = {"role": "system", "content": f"{plain[0]['content']}\n\n{description}"}
    else:
        plain.insert(0, {"role": "system", "content": description})
    return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)


def template_message(message: dict) -> dict:
    """A message for a tools-aware template: the calls' arguments as objects (what HF templates expect)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = [{"type": "function", "function": {"name": call["function"]["name"],
                                                "arguments": call_arguments(call["function"]["arguments"])}}
              for call in calls]
    return message | {"content": message.get("content") or "", "tool_calls": parsed}


def call_arguments(text: str):
    """A call's arguments as an object, or as given where they are not a JSON object (the template shows them)."""
    try:
        arguments = json.loads(text or "{}")
    except json.JSONDecodeError:
        return text
    return arguments if isinstance(arguments, dict) else text


def written_call(message: dict) -> str:
    """A message's text, with its tool calls written in <tool_call> tags (for templates that know no tools)."""
    calls = [f'<tool_call>\n{{"name": {json.dumps(call["function"]["name"])}, '
             f'"arguments": {call["function"]["arguments"] or "{}"}}}\n</tool_call>'
             for call in message.get("tool_calls") or []]
    text = [message["content"]] if message.get("content") else []
    return "\n".join(text + calls)


def parse_tool_call(text: str, tools: list[Tool]) -> dict | None:
    """{"name", "arguments"} when text is a call of one of the tools (bare JSON or within <tool_call> tags), else None."""
    match = TOOL_CALL_TAGS.match(text)
    try:
        call = json.loads(match.group(1) if match else text)
    except json.JSONDecodeError:
        return None
    names = {tool.function.name for tool in tools}
    if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments"), dict):
        return None
    return {"name": call["name"], "arguments": call["arguments"]}


def openai_tool_calls(call: dict) -> list[dict]:
    """A parsed call in OpenAI's message form (the arguments as a JSON string, as OpenAI sends them)."""
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]
