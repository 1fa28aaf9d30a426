"""Structured output: OpenAI's response_format as a grammar constraint on the target's rows and the drafts.

The grammar library is xgrammar: a JSON schema (or any JSON object) compiles into a grammar over the model's
tokens; a matcher advanced over the tokens generated so far gives the bitmask of tokens allowed next. The
constraint is a logits-processor stage (accelgen/processors.py), so it sees each tree row with its own path:
the matcher moves to that path (rolling back what the previous row added, accepting the rest), fills the row's
mask, and a draft token the grammar refuses is masked out at its parent's row, so verification rejects it. A
draft model drafting through the same pipeline proposes grammatical tokens only.

JSON is generated without free whitespace (xgrammar's `any_whitespace=False`: separators as `json.dumps`
writes them), so a model cannot loop on blank space inside the object.
"""

from __future__ import annotations

import json
import re
import weakref

import torch

from accelgen.errors import InputError

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def grammar_constraint(response_format: dict | None, tokenizer, vocab_size: int, eos_token_ids: set[int],
                       prompt_length: int) -> "GrammarConstraint | None":
    """The processor stage enforcing response_format ({"type": "text" | "json_object" | "json_schema", ...}), or
    None for free text. Raises ValueError for an unknown type, a schema the library rejects or a tokenizer it
    cannot handle."""
    kind = format_type(response_format)
    if kind == "text":
        return None
    if tokenizer is None:
        raise InputError(f"response_format {kind!r} needs a tokenizer (its grammar is over the tokens' text): pass "
                         "the model's tokenizer")
    compiler = grammar_compiler(tokenizer, vocab_size, eos_token_ids)
    if kind == "json_object":
        compiled = compiler.compile_builtin_json_grammar()
    else:
        schema = json_schema_of(response_format)
        try:
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        except Exception as error:  # xgrammar raises RuntimeError/ValueError with its own message
            raise InputError(f"response_format json_schema: the grammar library rejected the schema: "
                             f"{library_message(error)}") from None
    return GrammarConstraint(compiled, prompt_length)


def format_type(response_format) -> str:
    """The checked `type` of an OpenAI response_format (None: "text")."""
    if response_format is None:
        return "text"
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise InputError(f"response_format must be a mapping with a \"type\", got {response_format!r}")
    kind = response_format["type"]
    if kind not in RESPONSE_FORMAT_TYPES:
        raise InputError(f"unknown response_format type {kind!r}; choose one of {', '.join(RESPONSE_FORMAT_TYPES)}")
    return kind


def json_schema_of(response_format: dict) -> dict:
    """The schema of {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise InputError("response_format of type json_schema needs \"json_schema\": {\"name\": ..., \"schema\": "
                         f"{{...}}}}, got {spec!r}")
    return spec["schema"]


# one compiler per tokenizer, vocabulary and stop tokens: building the token table takes a noticeable fraction of a
# second, and the compiler caches the grammars it compiled
_COMPILERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def grammar_compiler(tokenizer, vocab_size: int, eos_token_ids: set[int]):
    try:
        import xgrammar
    except ImportError:
        raise InputError("response_format needs the grammar library xgrammar: "
                         "pip install \"accelgen[structured]\"") from None
    key = (vocab_size, tuple(sorted(eos_token_ids)))
    try:
        compilers = _COMPILERS.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable: no cache
        compilers = {}
    if key not in compilers:
        try:
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                           stop_token_ids=list(key[1]) or None)
        except Exception as error:
            raise InputError(f"response_format: the grammar library cannot use this tokenizer "
                             f"({type(tokenizer).__name__}): {library_message(error)}") from None
        compilers[key] = xgrammar.GrammarCompiler(info)
    return compilers[key]


def library_message(error: Exception) -> str:
    """xgrammar's message without the time stamp and source location its C++ checks put in front."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", lines[0])


class GrammarConstraint:
    """A processor stage masking, in each row, the tokens the grammar does not allow after that row's generated
    tokens (its context past the prompt). Rows whose tokens the grammar already refused, or after it ended (at
    EOS), are left as they are: such rows follow a token that its own parent row masked, never accepted."""

    def __init__(self, compiled_grammar, prompt_length: int):
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled_grammar)
        self.prompt_length = prompt_length
        self.accepted: list[int] = []  # the generated tokens the matcher stands after, in order

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """input_ids (k, L) long, scores (k, vocab) float32 -> scores with disallowed tokens at -inf."""
        import xgrammar

        # the matcher runs on the host: it reads the rows' tokens and fills a host bitmask, then sent to the scores
        bitmask = xgrammar.allocate_token_bitmask(len(scores), scores.shape[-1])  # (k, ceil(vocab/32)): all allowed
        for row, ids in enumerate(input_ids.tolist()):
            if self.move_to(ids[self.prompt_length :]):
                self.matcher.fill_next_token_bitmask(bitmask, row)
        xgrammar.apply_token_bitmask_inplace(scores, bitmask.to(scores.device, non_blocking=True))
        return scores

    def move_to(self, tokens: list[int]) -> bool:
        """Bring the matcher to the state after tokens: roll back to what it shares with them, accept the rest.
        False when the grammar refuses one of them or has ended."""
        shared = 0
        while shared < min(len(tokens), len(self.accepted)) and tokens[shared] == self.accepted[shared]:
            shared += 1
        if shared < len(self.accepted):
            self.matcher.rollback(len(self.accepted) - shared)
            del self.accepted[shared:]
        for token in tokens[shared:]:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                return False
            self.accepted.append(token)
        return not self.matcher.is_terminated()
