"""What has been generated so far, and when to stop: EOS, stop strings, max_new_tokens, the context limit.

Tokens are added one at a time, even when a step commits several, so nothing after an EOS or a stop string
inside an accepted draft is ever emitted, and max_new_tokens is never overshot.
"""

from __future__ import annotations


class Output:
    def __init__(self, tokenizer, eos_token_ids: set[int], stop: list[str], max_new_tokens: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.stop = [s for s in stop if s]
        self.max_new_tokens = max_new_tokens
        self.token_ids: list[int] = []
        self.finish_reason: str | None = "length" if max_new_tokens == 0 else None
        self._stop_at: int | None = None  # character offset of the stop string in the decoded text
        self._streamed_chars = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int) -> bool:
        """Append one token; True when generation must stop (the token itself is kept)."""
        self.token_ids.append(token)
        if token in self.eos_token_ids:
            self.finish_reason = "stop"
        elif self.stop and self._find_stop() is not None:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
        return self.done

    def _find_stop(self) -> int | None:
        text = self._decoded()
        hits = [text.find(s) for s in self.stop if s in text]
        self._stop_at = min(hits) if hits else None
        return self._stop_at

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    @property
    def text(self) -> str:
        """The new text, cut before a stop string (the stop string itself is not part of the output)."""
        text = self._decoded()
        return text if self._stop_at is None else text[: self._stop_at]

    def stream_delta(self) -> str:
        """Text not yet streamed that can no longer change: incomplete UTF-8 and possible stop-string
        beginnings are held back until the next tokens (or the end) settle them."""
        text = self.text
        if not self.done:
            if text.endswith("\ufffd"):
                return ""
            text = text[: len(text) - self._held_back(text)]
        delta = text[self._streamed_chars :]
        self._streamed_chars = max(self._streamed_chars, len(text))
        return delta

    def _held_back(self, text: str) -> int:
        """Length of the longest end of text that begins some stop string."""
        return max((n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
