"""What has been generated so far, and when to stop: EOS, stop strings, max_new_tokens, the context limit.

Tokens are added one at a time, even when a step commits several, so nothing after an EOS or a stop string
inside an accepted draft is ever emitted, and max_new_tokens is never overshot.
"""

from __future__ import annotations

from accelgen.errors import InputError


class Output:
    def __init__(self, tokenizer, eos_token_ids: set[int], stop: list[str], max_new_tokens: int):
        """tokenizer: decodes the text (None: token ids only, the text stays empty, and stop strings cannot be
        matched)."""
        if tokenizer is None and any(stop):
            raise InputError("stop strings need a tokenizer to read the generated text: pass the model's tokenizer, "
                             "or end generation with eos_token_id")
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.stop = StopStrings([s for s in stop if s])
        self.max_new_tokens = max_new_tokens
        self.token_ids: list[int] = []
        self.finish_reason: str | None = "length" if max_new_tokens == 0 else None
        self._streamed_chars = 0
        # how the text is read (set_text_options): transformers' decode arguments, whether the stop string and a
        # stopping token's text stay in it, and how many tokens come before any stop may end the output
        self.decode_options = {"skip_special_tokens": True}
        self.keep_stop_string = False
        self.keep_stop_token = True
        self.min_tokens = 0
        self.decoded = IncrementalText(tokenizer, self.decode_options)

    def set_text_options(self, *, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                         include_stop: bool = False, min_tokens: int = 0) -> None:
        """vLLM's output options (the server's): decoding with or without special tokens; the stop string, or
        the stop token's text, kept in the text (include_stop); no EOS, stop token or stop string ending the
        output before min_tokens tokens (EOS is also banned by the MinNewTokens processor: this keeps a stop
        string found in the first tokens from ending it, and a stop string then ends only where it is found
        after them, as vLLM's)."""
        if self.token_ids:
            raise InputError("text options are set before the first token")
        self.decode_options = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:  # transformers' slow tokenizers read it; fast ones never add spaces
            self.decode_options["spaces_between_special_tokens"] = False
        self.decoded = IncrementalText(self.tokenizer, self.decode_options)
        self.keep_stop_string = self.keep_stop_token = include_stop
        self.min_tokens = min_tokens

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int) -> bool:
        """Append one token; True when generation must stop (the token itself is kept)."""
        self.token_ids.append(token)
        before_min = len(self.token_ids) < self.min_tokens
        ends_by_token = not before_min and token in self.eos_token_ids
        if not ends_by_token or self.keep_stop_token:  # vLLM leaves a stop token's text out
            self.decoded.append(token)
        if before_min:
            if self.stop:  # matched on, so that a stop string across the boundary is found, but not yet ending
                self._read_stops(may_end=False)
        elif ends_by_token:
            self.finish_reason = "stop"
        elif self.stop and self._read_stops() is not None:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
        return self.done

    def _read_stops(self, may_end: bool = True) -> int | None:
        """Match the stop strings on the text the new tokens settled (an incomplete UTF-8 character waits for
        its last byte); returns where a stop string found begins. may_end=False: none found ends the output."""
        new_text, rewritten = self.decoded.settle()
        if rewritten:
            self.stop.restart()
        if not may_end:
            self.stop.ends_after = self.decoded.length
        self.stop.feed(new_text)
        return self.stop.found_at

    @property
    def text(self) -> str:
        """The new text, cut before a stop string (the stop string itself is not part of the output, unless
        set_text_options kept it)."""
        text = self.decoded.text()
        if self.stop.found_at is None:
            return text
        return text[: self.stop.found_end if self.keep_stop_string else self.stop.found_at]

    def stream_delta(self) -> str:
        """Text not yet streamed that can no longer change: incomplete UTF-8 and possible stop-string
        beginnings are held back until the next tokens (or the end) settle them."""
        self.decoded.settle(final=self.done)
        end = self.decoded.length
        if self.stop.found_at is not None:
            end = self.stop.found_end if self.keep_stop_string else self.stop.found_at
        elif not self.done:
            end -= self.stop.held_back
        if end <= self._streamed_chars:
            return ""
        delta = self.decoded.tail(self._streamed_chars)[: end - self._streamed_chars]
        self._streamed_chars = end
        return delta


class IncrementalText:
    """Token ids decoded as they arrive, in time proportional to the new tokens, not to the text so far (the
    incremental detokenization of vLLM and TGI): each settle() decodes a short window, the tokens from `prefix`
    on, and keeps what it adds to the window's already settled part, ids[prefix:read]. Both decodes start at the
    same token, so what a tokenizer does to a text's first token (a SentencePiece leading space) cancels out.
    Text ending in an incomplete UTF-8 character (U+FFFD) waits for the next tokens.

    A tokenizer that rewrites settled text when more follows (cleaning up a space before punctuation) is seen
    as a window whose text does not extend its settled part: the whole text is then decoded again, once."""

    def __init__(self, tokenizer, decode_options: dict):
        """tokenizer: None gives no text."""
        self.tokenizer = tokenizer
        self.decode_options = decode_options
        self.ids: list[int] = []
        self.pieces: list[str] = []  # the settled text, piece by piece
        self.length = 0  # its length in characters
        self.prefix = 0  # the window's first token
        self.read = 0  # ids[:read] are settled

    def append(self, token: int) -> None:
        self.ids.append(token)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.decode_options) if ids else ""

    def _window(self) -> tuple[str, str]:
        """(the window's settled text, the window's whole text)."""
        return self._decode(self.ids[self.prefix : self.read]), self._decode(self.ids[self.prefix :])

    def settle(self, final: bool = False) -> tuple[str, bool]:
        """(text the tokens appended since the last call settled, whether the text was decoded again from the
        start, that text then being all of it). final: an incomplete character is settled as it decodes."""
        if self.tokenizer is None or self.read == len(self.ids):
            return "", False
        settled, window = self._window()
        if window.endswith("\ufffd") and not final:
            return "", False
        if not window.startswith(settled):
            whole = self._decode(self.ids)
            self.pieces, self.length = [whole], len(whole)
            self.prefix = self.read = len(self.ids)
            return whole, True
        new_text = window[len(settled) :]
        self.pieces.append(new_text)
        self.length += len(new_text)
        self.prefix, self.read = self.read, len(self.ids)
        return new_text, False

    def tail(self, start: int) -> str:
        """The settled text from character `start` on, read from the last pieces only."""
        pieces, begins = [], self.length
        for piece in reversed(self.pieces):
            if begins <= start:
                break
            begins -= len(piece)
            pieces.append(piece)
        return "".join(reversed(pieces))[start - begins :]

    def text(self) -> str:
        """All the text: the settled part and, unsettled, what the tokens after it decode to so far."""
        if self.tokenizer is None:
            return ""
        settled, window = self._window()
        pending = window[len(settled) :] if window.startswith(settled) else None
        if pending is None:  # a rewrite not yet settled: the whole text, decoded again
            return self._decode(self.ids)
        return "".join(self.pieces) + pending


class StopStrings:
    """Stop strings matched as text arrives, in time linear in the text, whatever their length
    (Knuth–Morris–Pratt): for each stop string, the length of its longest prefix that ends the text so far.

    Trying every prefix of a stop string against the text's end instead costs O(len(stop)²) per token, which
    one long stop string turns into seconds per token."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.failures = [prefix_function(stop) for stop in stops]  # O(len(stop)) once
        self.ends_after = 0  # a stop string ending at or before this character is not found (Output.min_tokens)
        self.restart()

    def __bool__(self) -> bool:
        return bool(self.stops)

    def restart(self) -> None:
        """Forget the text fed: matching starts over (a tokenizer rewrote it)."""
        self.fed = 0  # characters matched so far
        self.matched = [0] * len(self.stops)  # per stop string: its longest prefix that ends the text fed
        self.found_at: int | None = None  # where the earliest stop string found begins
        self.found_end: int | None = None  # and where it ends

    def feed(self, new_text: str) -> None:
        """Match new_text, which follows the text fed before (restart() first when the text starts over)."""
        start = self.fed
        for k, (stop, failure) in enumerate(zip(self.stops, self.failures)):
            matched = self.matched[k]
            for i, char in enumerate(new_text, start):
                while matched and (matched == len(stop) or stop[matched] != char):
                    matched = failure[matched - 1]
                if stop[matched] == char:
                    matched += 1
                if matched == len(stop) and i + 1 > self.ends_after and (
                        self.found_at is None or i + 1 - matched < self.found_at):
                    self.found_at = i + 1 - matched  # several found in one token: the earliest one cuts
                    self.found_end = i + 1
            self.matched[k] = matched
        self.fed += len(new_text)

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
