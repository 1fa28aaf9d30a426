"""Engine events shaped into OpenAI's replies: completion and chat.completion objects, their stream chunks and
server-sent events, usage, logprobs in both of OpenAI's forms, and accelgen's statistics field."""

from __future__ import annotations

import json
import math
import time
import uuid

from accelgen.loop import GenerationResult
from accelgen.server.schemas import Shape
from accelgen.server.tools import openai_tool_calls, parse_tool_call


LOWEST_LOGPROB = -9999.0  # what OpenAI reports for a token that could not be drawn (JSON has no -inf)


class Reply:
    """Shapes engine events into OpenAI's completion / chat.completion objects and their stream chunks, one choice
    per sequence. Logprobs arrive as chat-form entries (logprob_entries)."""

    def __init__(self, model_name: str, method: str, shape: Shape, prompt_tokens: int, n: int, echo: str = ""):
        self.id = ("chatcmpl-" if shape.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model_name, self.method, self.shape, self.prompt_tokens, self.n = model_name, method, shape, prompt_tokens, n
        self.echo = echo
        self.offsets = [len(echo)] * n  # completions: each choice's text so far (the next token's text_offset)

    @property
    def chat(self) -> bool:
        return self.shape.chat

    @property
    def buffered(self) -> bool:
        """Whether a stream sends each answer whole at its end: with tools, whether it is a call shows only then."""
        return self.chat and bool(self.shape.tools)

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model_name,
                "choices": choices}

    def _logprobs(self, index: int, entries: list[dict] | None, text: str) -> dict | None:
        if entries is None:
            return None
        if self.chat:
            return {"content": entries, "refusal": None}
        shaped = completion_logprobs(entries, self.offsets[index])
        self.offsets[index] += len(text)
        return shaped

    def opening_chunks(self) -> list[dict]:
        """A stream's first chunks: chat announces the role of each choice; an echoed completion sends the prompt."""
        if self.chat:
            return [self._envelope("chat.completion.chunk", [{"index": i, "delta": {"role": "assistant",
                                                                                    "content": self.echo},
                                                              "logprobs": None, "finish_reason": None}])
                    for i in range(self.n)]
        return [self.chunk(i, self.echo) for i in range(self.n)] if self.echo else []

    def chunk(self, index: int, text: str, entries: list[dict] | None = None) -> dict:
        logprobs = self._logprobs(index, entries, text)
        if self.chat:
            return self._envelope("chat.completion.chunk", [{"index": index, "delta": {"content": text},
                                                             "logprobs": logprobs, "finish_reason": None}])
        return self._envelope("text_completion", [{"index": index, "text": text, "finish_reason": None,
                                                   "logprobs": logprobs}])

    def finish_chunk(self, index: int, result: GenerationResult, entries: list[dict] | None) -> dict:
        """The chunk that ends a choice; a buffered answer (tools) comes whole in it."""
        if not self.buffered:
            finish_reason = openai_finish_reason(result.finish_reason)
            if self.chat:
                return self._envelope("chat.completion.chunk", [{"index": index, "delta": {}, "logprobs": None,
                                                                 "finish_reason": finish_reason}])
            return self._envelope("text_completion", [{"index": index, "text": "", "logprobs": None,
                                                       "finish_reason": finish_reason}])
        message, finish_reason = self.message(result)
        delta = {"content": message["content"]} if message["content"] is not None else \
            {"tool_calls": [call | {"index": i} for i, call in enumerate(message["tool_calls"])]}
        return self._envelope("chat.completion.chunk", [{"index": index, "delta": delta, "finish_reason": finish_reason,
                                                         "logprobs": self._logprobs(index, entries, "")}])

    def usage_chunk(self, results: list[GenerationResult]) -> dict:
        """The last stream chunk when the client asked for usage (stream_options.include_usage)."""
        object_name = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(object_name, []) | {"usage": self.usage(results), "accelgen": self.statistics(results)}

    def message(self, result: GenerationResult) -> tuple[dict, str]:
        """A chat answer and its finish reason: a call of one of the tools (tool_calls), or text."""
        call = parse_tool_call(result.text, self.shape.tools) if self.shape.tools else None
        if call is not None:
            return {"role": "assistant", "content": None, "tool_calls": openai_tool_calls(call)}, "tool_calls"
        return {"role": "assistant", "content": self.echo + result.text}, openai_finish_reason(result.finish_reason)

    def final(self, results: list[GenerationResult], entries: list[list[dict] | None]) -> dict:
        choices = []
        for index, (result, logprobs) in enumerate(zip(results, entries)):
            if self.chat:
                message, finish_reason = self.message(result)
                choices.append({"index": index, "message": message, "finish_reason": finish_reason,
                                "logprobs": self._logprobs(index, logprobs, result.text)})
            else:
                choices.append({"index": index, "text": self.echo + result.text,
                                "finish_reason": openai_finish_reason(result.finish_reason),
                                "logprobs": self._logprobs(index, logprobs, result.text)})
        envelope = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        return envelope | {"usage": self.usage(results), "accelgen": self.statistics(results)}

    def usage(self, results: list[GenerationResult]) -> dict:
        """OpenAI's usage (the prompt counted once, as OpenAI does for n > 1); the draft tokens the target accepted
        and rejected fill completion_tokens_details' accepted and rejected prediction tokens."""
        completion = sum(len(result.token_ids) for result in results)
        drafted = sum(result.stats["draft_tokens"] for result in results)
        accepted = sum(result.stats["accepted_draft_tokens"] for result in results)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": drafted - accepted}}

    def statistics(self, results: list[GenerationResult]) -> dict:
        """The extension field "accelgen": what speculation did for this request (over all its choices)."""
        tokens = sum(len(result.token_ids) for result in results)
        forwards = sum(result.stats["target_forwards"] for result in results)
        drafted = sum(result.stats["draft_tokens"] for result in results)
        accepted = sum(result.stats["accepted_draft_tokens"] for result in results)
        return {"method": self.method, "target_forwards": forwards, "draft_tokens": drafted,
                "accepted_draft_tokens": accepted,
                "mean_accepted_tokens": round(tokens / forwards, 4) if forwards else 0.0,
                "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0}


def openai_finish_reason(reason: str) -> str:
    return {"stop": "stop", "length": "length"}.get(reason, "abort")


def logprob_entries(tokenizer, logprobs: list | None) -> list[dict] | None:
    """TokenLogprobs (loop.py) in OpenAI's chat form: {token, logprob, bytes, top_logprobs: [...]} per token."""
    if logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        logprob = float(logprob)  # NaN where the processing left no token possible: none could be drawn either
        logprob = LOWEST_LOGPROB if math.isnan(logprob) else max(logprob, LOWEST_LOGPROB)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [entry(item.token_id, item.logprob) | {"top_logprobs": [entry(token, value) for token, value in item.top]}
            for item in logprobs]


def completion_logprobs(entries: list[dict], offset: int) -> dict:
    """Chat-form entries in the completions' (legacy) form; offset: the text's length before the first token."""
    starts = [offset]
    for entry in entries[:-1]:
        starts.append(starts[-1] + len(entry["token"]))
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": starts}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
