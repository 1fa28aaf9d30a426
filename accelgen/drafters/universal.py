"""Universal assisted decoding: a draft model with a different tokenizer drafts text (Timor et al. 2025).

The draft model and the target share text, not token ids. Each step:

1. target → draft: the committed target tokens are decoded to text and re-encoded with the draft tokenizer;
   the draft KV cache is rolled back to the longest prefix it shares with that encoding (`catch_up`), so
   only the re-tokenized tail is fed again. Target tokens that end inside a UTF-8 character are held back
   (their text is not known yet) and must reappear at the start of the proposal.
2. the draft model drafts `gamma` tokens greedily (stopping after an EOS); their text is cut out of a decode
   of the draft context tail, so tokenizers that drop a leading space still give the right text.
3. draft → target: the draft text is appended to the text of the last few committed target tokens and
   encoded with the target tokenizer; the proposal is what follows the exact token boundary at the end of the
   committed text. When the target tokenizer merges across that boundary (' hel' + 'lo' → ' hello') there is
   no such boundary, and the draft text is encoded alone: after ' hel' the target can only continue with 'lo'.

Special tokens travel as their text: one both tokenizers know (e.g. '<|im_end|>') is kept, the draft's EOS
becomes the target's EOS, any other is dropped. The target verifies by greedy match, so a misaligned
proposal only costs acceptance, never correctness.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from accelgen.draft import Draft, Verdict
from accelgen.drafters.base import BuildContext, Drafter
from accelgen.drafters.draft_decoding import TokenChoice, decode_draft
from accelgen.errors import InputError
from accelgen.prompts import eos_token_ids
from accelgen.models.engines import runner_for
from accelgen.registry import MethodOptions, MethodSpec, Part, register

LOOKBEHIND = 8  # committed tokens re-decoded around a boundary: enough for any merge to settle
MAX_PENDING = 3  # a UTF-8 character has at most 4 bytes, so at most 3 tokens can end inside one

Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]


# --- pure text/token alignment helpers ---------------------------------------------------------------------


def complete_prefix_length(decode: Decode, ids: list[int]) -> int:
    """Length of the longest prefix of ids whose text does not end inside a UTF-8 character.

    A byte-level token can hold the first bytes of a character; decoding then ends with U+FFFD. Up to
    MAX_PENDING such trailing tokens are held back. Example (byte ids): 'ok 😀' cut after two of the emoji's
    four bytes -> 3.
    """
    for held_back in range(min(MAX_PENDING, len(ids)) + 1):
        end = len(ids) - held_back
        if not decode(ids[max(0, end - LOOKBEHIND) : end]).endswith("\ufffd"):
            return end
    return len(ids)  # a genuine U+FFFD, or bytes that never form a character: nothing to wait for


def new_text(decode: Decode, context_ids: list[int], new_ids: list[int]) -> str:
    """The text new_ids add after context_ids: decoded together with the context's tail, because some
    tokenizers decode a token alone differently (SentencePiece drops the leading space of the first token)."""
    tail = context_ids[-LOOKBEHIND:]
    before, after = decode(tail), decode(tail + new_ids)
    return after[len(before) :] if after.startswith(before) else decode(new_ids)


def continuation_ids(encode: Encode, decode: Decode, window_ids: list[int], text: str) -> list[int]:
    """Token ids that continue window_ids with text, as the tokenizer splits the two texts together.

    The first token boundary that falls exactly at the end of the window's text starts the continuation.
    Example: window [' hello'] and text ' world' -> [' world']. When a token spans the boundary (window
    [' hel'], text 'lo world' encode together as [' hello', ' world']) the text is encoded alone: ['lo', ' world'].
    """
    window_text = decode(window_ids)
    ids = encode(window_text + text)
    if ids[: len(window_ids)] == window_ids:  # the common case: the window re-encodes to itself
        return ids[len(window_ids) :]
    for split in range(len(ids) + 1):
        if decode(ids[:split]) == window_text:
            return ids[split:]
    return encode(text)


def strip_incomplete_character(text: str) -> str:
    """Drop a trailing partial UTF-8 character (decoded as U+FFFD): its bytes are not text yet."""
    return text.rstrip("\ufffd")


def special_token_map(source, destination) -> dict[str, str]:
    """Text of the source tokenizer's special tokens -> the text to use for the destination tokenizer.

    A special token the destination also has (same text) is left alone and not listed; the source's EOS
    becomes the destination's EOS; every other special token is dropped (mapped to '').
    """
    known = set(destination.get_added_vocab())
    specials = set(source.all_special_tokens)
    specials.update(token.content for token in source.added_tokens_decoder.values() if token.special)
    mapping = {}
    for token in specials - known:
        is_eos = token == source.eos_token and destination.eos_token is not None
        mapping[token] = destination.eos_token if is_eos else ""
    return mapping


def translate_special_tokens(text: str, mapping: dict[str, str]) -> str:
    for token in sorted(mapping, key=len, reverse=True):  # longest first: one special may contain another
        text = text.replace(token, mapping[token])
    return text


def leading_special_ids(tokenizer) -> list[int]:
    """The ids the tokenizer puts before any text (a BOS token), found by encoding a sample with and without
    special tokens."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


# --- the drafter -----------------------------------------------------------------------------------------


class TextCodec:
    """One tokenizer's encode/decode as used here: special tokens kept as text, no space clean-up."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


class UniversalDrafter(Drafter):
    def __init__(self, draft_model, target_tokenizer, draft_tokenizer, gamma: int = 5):
        if gamma < 1:
            raise InputError(f"gamma must be >= 1, got {gamma}")
        self.runner = runner_for(draft_model)
        self.target = TextCodec(target_tokenizer)
        self.draft = TextCodec(draft_tokenizer)
        self.gamma = gamma
        self.to_draft_specials = special_token_map(target_tokenizer, draft_tokenizer)
        self.to_target_specials = special_token_map(draft_tokenizer, target_tokenizer)
        self.draft_bos = leading_special_ids(draft_tokenizer)
        # greedy draft tokens, ending after the draft model's EOS
        self.choice = TokenChoice(stop_tokens=frozenset(eos_token_ids(draft_model, draft_tokenizer)))
        self.cached_tokens: list[int] = []  # draft tokens whose KV the draft cache holds, in order

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        committed = context.tolist()
        complete = complete_prefix_length(self.target.decode, committed)
        pending = committed[complete:]  # target tokens ending inside a character: the proposal must repeat them
        draft_context = self.draft_context(committed[:complete])
        if not draft_context:
            return Draft.empty()
        drafted, _ = decode_draft(self.runner, self.cached_tokens, draft_context, self.gamma, self.choice)
        if not drafted:  # the draft model's context is full
            return Draft.empty()
        text = strip_incomplete_character(new_text(self.draft.decode, draft_context, drafted))
        text = translate_special_tokens(text, self.to_target_specials)
        window = committed[max(0, complete - LOOKBEHIND) : complete]
        proposal = continuation_ids(self.target.encode, self.target.decode, window, text)
        if proposal[: len(pending)] != pending:  # the draft's text does not complete the pending character
            return Draft.empty()
        return Draft.chain(torch.tensor(proposal[len(pending) :], dtype=torch.long))

    def draft_context(self, target_ids: list[int]) -> list[int]:
        """The committed text in draft tokens, as the draft tokenizer would split it (with its BOS, if any)."""
        text = translate_special_tokens(self.target.decode(target_ids), self.to_draft_specials)
        ids = self.draft.encode(text)
        if self.draft_bos and ids[: len(self.draft_bos)] != self.draft_bos:
            ids = self.draft_bos + ids
        return ids

    def update(self, draft: Draft, verdict: Verdict, target_logits: torch.Tensor) -> None:
        pass  # the next proposal re-aligns from the committed text itself


def load_draft_tokenizer(draft_tokenizer, draft_model):
    """A tokenizer object as given; else load one from a name or folder, by default the draft model's own
    name_or_path (set by from_pretrained, so `accelgen.load_model` and the CLI's --draft provide it)."""
    if draft_tokenizer is not None and not isinstance(draft_tokenizer, (str, os.PathLike)):
        return draft_tokenizer
    source = str(draft_tokenizer or getattr(draft_model, "name_or_path", "") or "")
    if not source:
        raise InputError("method 'universal' needs the draft model's tokenizer, and the draft model does not say "
                         "where it was loaded from: pass draft_tokenizer= (a tokenizer, or a name or folder; "
                         "CLI: -o draft_tokenizer=NAME)")
    from transformers import AutoTokenizer

    from accelgen.models.embedded import EMBEDDED_MODELS
    from accelgen.models.loading import prepare_embedded

    try:
        folder = prepare_embedded(source) if source in EMBEDDED_MODELS else source
        return AutoTokenizer.from_pretrained(folder)
    except Exception as error:  # transformers raises OSError, ValueError or a hub error, depending on the source
        raise InputError(f"could not load the draft tokenizer from {source!r} ({type(error).__name__}: {error}); "
                         "pass draft_tokenizer= (CLI: -o draft_tokenizer=NAME)") from error


@dataclass(frozen=True)
class UniversalOptions(MethodOptions):
    gamma: int = 5  # draft-model tokens per step
    draft_tokenizer: object = None  # the draft model's tokenizer, or its name or folder (None: the draft model's)


def _make(build: BuildContext, options: UniversalOptions) -> UniversalDrafter:
    if build.tokenizer is None:
        raise InputError("method 'universal' needs the target tokenizer (tokenizer=)")
    draft_tokenizer = load_draft_tokenizer(options.draft_tokenizer, build.draft_model)
    return UniversalDrafter(build.draft_model, build.tokenizer, draft_tokenizer, options.gamma)


register(
    MethodSpec(
        name="universal",
        family="speculative",
        lossless="greedy-exact",
        paper="Timor et al. 2025, arXiv:2502.05202 (HF universal assisted generation)",
        summary="a draft model with a different tokenizer drafts text; it is re-tokenized for the target and verified",
        drafter=Part(_make, UniversalOptions),
        needs=("draft_model",),
    )
)
