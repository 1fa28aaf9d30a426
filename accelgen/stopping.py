"""What has been generated so far, and when to stop: EOS, stop strings, max_new_tokens, the context limit.

Tokens are added one at a time, even when a step commits several, so nothing after an EOS or a stop string
inside an accepted draft is ever emitted, and max_new_tokens is never overshot.
"""

from __future__ import annotations


class Output:
    def __init__(self, tokenizer, eos_token_ids: set[int], stop: list[str], max_new_tokens: int):
        """tokenizer: decodes the text (None: token ids only, the text stays empty, and stop strings cannot be
        matched)."""
        if tokenizer is None and any(stop):
            raise ValueError("stop strings need a tokenizer to read the generated text: pass the model's tokenizer, "
                             "or end generation with eos_token_id")
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.stop = StopStrings([s for s in stop if s])
        self.max_new_tokens = max_new_tokens
        self.token_ids: list[int] = []
        self.finish_reason: str | None = "length" if max_new_tokens == 0 else None
        self._streamed_chars = 0
        self._decoded_ids = 0  # how many tokens _decoded_text holds
        self._decoded_text = ""
        # how the text is read (set_text_options): transformers' decode arguments, whether the stop string and a
        # stopping token's text stay in it, and how many tokens come before any stop may end the output
        self.decode_options = {"skip_special_tokens": True}
        self.keep_stop_string = False
        self.keep_stop_token = True
        self.min_tokens = 0
        self._stopped_by_token = False

    def set_text_options(self, *, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                         include_stop: bool = False, min_tokens: int = 0) -> None:
        """vLLM's output options (the server's): decoding with or without special tokens; the stop string, or
        the stop token's text, kept in the text (include_stop); no EOS, stop token or stop string ending the
        output before min_tokens tokens (EOS is also banned by the MinNewTokens processor: this keeps a stop
        string found in the first tokens from ending it, and a stop string then ends only where it is found
        after them, as vLLM's)."""
        if self.token_ids:
            raise ValueError("text options are set before the first token")
        self.decode_options = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:  # transformers' slow tokenizers read it; fast ones never add spaces
            self.decode_options["spaces_between_special_tokens"] = False
        self.keep_stop_string = self.keep_stop_token = include_stop
        self.min_tokens = min_tokens

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int) -> bool:
        """Append one token; True when generation must stop (the token itself is kept)."""
        self.token_ids.append(token)
        if len(self.token_ids) < self.min_tokens:
            if self.stop:  # matched on, so that a stop string across the boundary is found, but not yet ending
                self.stop.ends_after = len(self._settled())
                self.stop.feed(self._settled())
        elif token in self.eos_token_ids:
            self.finish_reason = "stop"
            self._stopped_by_token = True
        elif self.stop and self._find_stop() is not None:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
        return self.done

    def _find_stop(self) -> int | None:
        # an incomplete UTF-8 character decodes to U+FFFD until its last byte arrives: match settled text only
        self.stop.feed(self._settled())
        return self.stop.found_at

    def _settled(self) -> str:
        return self._decoded().rstrip("\ufffd")

    def _decoded(self) -> str:
        ids = self.token_ids
        if self._stopped_by_token and not self.keep_stop_token:  # vLLM leaves a stop token's text out
            ids = ids[:-1]
        if self._decoded_ids != len(ids) and self.tokenizer is not None:
            self._decoded_text = self.tokenizer.decode(ids, **self.decode_options)
            self._decoded_ids = len(ids)
        return self._decoded_text

    @property
    def text(self) -> str:
        """The new text, cut before a stop string (the stop string itself is not part of the output, unless
        set_text_options kept it)."""
        text = self._decoded()
        if self.stop.found_at is None:
            return text
        return text[: self.stop.found_end if self.keep_stop_string else self.stop.found_at]

    def stream_delta(self) -> str:
        """Text not yet streamed that can no longer change: incomplete UTF-8 and possible stop-string
        beginnings are held back until the next tokens (or the end) settle them."""
        text = self.text
        if not self.done:
            if text.endswith("\ufffd"):
                return ""
            text = text[: len(text) - self.stop.held_back]
        delta = text[self._streamed_chars :]
        self._streamed_chars = max(self._streamed_chars, len(text))
        return delta


class StopStrings:
    """Stop strings matched as text arrives, in time linear in the text, whatever their length
    (Knuth–Morris–Pratt): for each stop string, the length of its longest prefix that ends the text so far.

    Trying every prefix of a stop string against the text's end instead costs O(len(stop)²) per token, which
    one long stop string turns into seconds per token."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.failures = [prefix_function(stop) for stop in stops]  # O(len(stop)) once
        self.ends_after = 0  # a stop string ending at or before this character is not found (Output.min_tokens)
        self._restart()

    def __bool__(self) -> bool:
        return bool(self.stops)

    def _restart(self) -> None:
        self.text = ""  # the text matched so far
        self.matched = [0] * len(self.stops)  # per stop string: its longest prefix that ends self.text
        self.found_at: int | None = None  # where the earliest stop string found begins
        self.found_end: int | None = None  # and where it ends

    def feed(self, text: str) -> None:
        """Match text, which extends the text fed before. A tokenizer may rewrite the end of a decoded text
        (rarely: cleaning up spaces before punctuation); then matching starts over on the whole text."""
        if not text.startswith(self.text):
            self._restart()
        start = len(self.text)
        for k, (stop, failure) in enumerate(zip(self.stops, self.failures)):
            matched = self.matched[k]
            for i in range(start, len(text)):
                char = text[i]
                while matched and (matched == len(stop) or stop[matched] != char):
                    matched = failure[matched - 1]
                if stop[matched] == char:
                    matched += 1
                if matched == len(stop) and i + 1 > self.ends_after and (
                        self.found_at is None or i + 1 - matched < self.found_at):
                    self.found_at = i + 1 - matched  # several found in one token: the earliest one cuts
                    self.found_end = i + 1
            self.matched[k] = matched
        self.text = text

    @property
    def held_back(self) -> int:
        """Characters at the end of the text that may begin a stop string: not final until the next tokens."""
        return max((m for m, stop in zip(self.matched, self.stops) if m < len(stop)), default=0)


def prefix_function(pattern: str) -> list[int]:
    """failure[i]: the length of the longest proper prefix of pattern[: i + 1] that is also a suffix of it."""
    failure = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = failure[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        failure[i] = k
    return failure
