"""Logits processors: what changes the target's scores before a token is chosen (penalties, bans, constraints).

Every stage has transformers' LogitsProcessor interface, `(input_ids (k, L) long, scores (k, vocab) float32) ->
scores`, where row j of input_ids is the whole context (prompt included) that scores row j follows. The stages HF
also offers (repetition_penalty, no_repeat_ngram_size, bad_words_ids, min_new_tokens) ARE transformers' own
processors, so their output is HF's by construction.

A step scores the root and every draft node in one forward; each row must be processed with its own context:
row 0 follows the committed context, row i+1 the committed context plus the tree path down to node i. The
pipeline groups the rows by depth (equal context lengths) and runs each stage once per group. A lossless method
then verifies against processed rows, so it stays exact against plain decoding with the same processors.

Everything a stage builds lives on the scores' device: the pipeline moves each row's context there (without
waiting for the device) before the stages see it.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from transformers import LogitsProcessor
from transformers.generation.logits_process import (
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from accelgen.draft import ROOT, Draft, to_device
from accelgen.errors import InputError

# a user's processor: (context_ids (n,) long, logits (vocab,) float32) -> logits (vocab,)
RowProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PenaltiesByCount:
    """OpenAI's presence and frequency penalties: subtract presence·[count > 0] + frequency·count, where count is
    how often a token occurs among the generated tokens (the prompt excluded)."""

    def __init__(self, prompt_length: int, presence: float, frequency: float):
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_length :].to(scores.device, non_blocking=True)  # (k, L - prompt)
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.presence * (counts > 0).to(scores.dtype) - self.frequency * counts


class MinNewTokens:
    """transformers' min_new_tokens rule: the EOS tokens are banned until that many tokens are generated. (Its own
    processor keeps the EOS ids on the CPU, which a GPU's scores refuse.)"""

    def __init__(self, prompt_length: int, min_new_tokens: int, eos: list[int]):
        self.prompt_length, self.min_new_tokens, self.eos = prompt_length, min_new_tokens, torch.tensor(eos)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] - self.prompt_length >= self.min_new_tokens:  # shapes only: no read
            return scores
        return scores.index_fill(1, to_device(self.eos, scores.device), float("-inf"))


class MinP:
    """vLLM's min_p: tokens less likely than min_p times the most likely one are dropped, the probabilities taken
    at the request's temperature. It runs before the temperature is applied, so the rule is written on logits:
    p_i < min_p · p_max  <=>  logit_i < logit_max + temperature · ln(min_p)."""

    def __init__(self, min_p: float, temperature: float):
        if not 0.0 < min_p <= 1.0:
            raise InputError(f"min_p must be in (0, 1] (0 disables it), got {min_p}")
        self.margin = temperature * math.log(min_p)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        threshold = scores.max(dim=-1, keepdim=True).values + self.margin
        return scores.masked_fill(scores < threshold, float("-inf"))


class AllowedTokens:
    """vLLM's allowed_token_ids: every other token is banned."""

    def __init__(self, token_ids: list[int], vocab_size: int):
        for token in token_ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                raise InputError(f"allowed_token_ids holds {token!r}, not a token id of this model "
                                 f"(0..{vocab_size - 1})")
        if not token_ids:
            raise InputError("allowed_token_ids must name at least one token")
        self.banned = torch.ones(vocab_size, dtype=torch.bool)
        self.banned[list(token_ids)] = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(to_device(self.banned, scores.device), float("-inf"))


class EachRow:
    """A user's per-row processor as a stage: called on each row with that row's context."""

    def __init__(self, processor: RowProcessor):
        self.processor = processor

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows = []
        for ids, row in zip(input_ids, scores):
            result = self.processor(ids, row.clone())
            if not isinstance(result, torch.Tensor) or result.shape != row.shape:
                shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
                raise InputError(f"logits processor {self.processor!r} must return a ({len(row)},) tensor of logits, "
                                 f"got {shape}")
            rows.append(result.to(scores.dtype))
        return torch.stack(rows)


class LogitsPipeline:
    """The stages of one request, applied in order to rows of target (or draft) logits."""

    def __init__(self, stages: list):
        self.stages = stages

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """input_ids (k, L) long, scores (k, vocab) -> (k, vocab) float32 processed scores (a new tensor), on the
        scores' device (input_ids are moved there)."""
        input_ids = input_ids.to(scores.device, non_blocking=True)
        scores = scores.float().clone()  # some HF stages write in place
        for stage in self.stages:
            scores = stage(input_ids, scores)
        return scores

    def row(self, context: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """One row: context (L,) long, logits (vocab,) -> (vocab,) processed."""
        return self(context[None], logits[None])[0]

    def tree_rows(self, context: torch.Tensor, draft: Draft, logits: torch.Tensor) -> torch.Tensor:
        """context (L,) long committed tokens, logits (n+1, vocab): row 0 after the root, row i+1 after draft node
        i -> (n+1, vocab) processed, each row with the context of its own tree path."""
        paths = tree_paths(draft)  # row r -> the draft tokens between the root and row r's position
        processed = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        by_depth: dict[int, list[int]] = {}
        for row, path in enumerate(paths):
            by_depth.setdefault(len(path), []).append(row)
        for rows in by_depth.values():
            ids = torch.stack([torch.cat([context, torch.tensor(paths[row], dtype=torch.long)]) for row in rows])
            rows = to_device(rows, logits.device)
            processed.index_copy_(0, rows, self(ids, logits.index_select(0, rows)))
        return processed


STAGES = (MinP, AllowedTokens)  # accelgen's own stages, which a caller may pass in logits_processors as they are


def tree_paths(draft: Draft) -> list[list[int]]:
    """For each logits row (root, then node i as row i+1), the draft tokens on the path from the root to it."""
    tokens = draft.tokens.tolist()
    paths: list[list[int]] = [[]]
    for node, parent in enumerate(draft.parents.tolist()):
        paths.append(paths[0 if parent == ROOT else parent + 1] + [tokens[node]])
    return paths


def build_pipeline(*, prompt_length: int, eos_token_ids: set[int], vocab_size: int, repetition_penalty: float = 1.0,
                   presence_penalty: float = 0.0, frequency_penalty: float = 0.0, no_repeat_ngram_size: int = 0,
                   min_new_tokens: int = 0, bad_words_ids: list[list[int]] | None = None,
                   logits_processors: list | None = None, constraint=None) -> LogitsPipeline | None:
    """The pipeline for these settings (in transformers' order, then OpenAI's penalties, the user's processors and
    the grammar constraint last), or None when nothing is enabled: the plain path does no per-row work.
    Raises ValueError naming a bad setting."""
    check_settings(repetition_penalty, presence_penalty, frequency_penalty, no_repeat_ngram_size, min_new_tokens,
                   logits_processors)
    eos = sorted(eos_token_ids)
    stages: list = []
    if repetition_penalty != 1.0:
        stages.append(RepetitionPenaltyLogitsProcessor(float(repetition_penalty)))
    if no_repeat_ngram_size > 0:
        stages.append(NoRepeatNGramLogitsProcessor(no_repeat_ngram_size))
    if bad_words_ids is not None:
        stages.append(bad_words_stage(bad_words_ids, eos, vocab_size))
    if min_new_tokens > 0 and eos:
        stages.append(MinNewTokens(prompt_length, min_new_tokens, eos))
    if presence_penalty or frequency_penalty:
        stages.append(PenaltiesByCount(prompt_length, float(presence_penalty), float(frequency_penalty)))
    for processor in logits_processors or []:
        stages.append(processor if isinstance(processor, (LogitsProcessor, *STAGES)) else EachRow(processor))
    if constraint is not None:
        stages.append(constraint)
    return LogitsPipeline(stages) if stages else None


def check_settings(repetition_penalty, presence_penalty, frequency_penalty, no_repeat_ngram_size, min_new_tokens,
                   logits_processors) -> None:
    numbers = {"repetition_penalty": repetition_penalty, "presence_penalty": presence_penalty,
               "frequency_penalty": frequency_penalty}
    for name, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InputError(f"{name} must be a finite number, got {value!r}")
    if repetition_penalty <= 0:
        raise InputError(f"repetition_penalty must be > 0 (1.0 disables it), got {repetition_penalty}")
    for name, value in {"no_repeat_ngram_size": no_repeat_ngram_size, "min_new_tokens": min_new_tokens}.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(f"{name} must be an integer >= 0, got {value!r}")
    if logits_processors is not None:
        if not isinstance(logits_processors, (list, tuple)):
            raise InputError(f"logits_processors must be a list of callables, got {type(logits_processors).__name__}")
        for processor in logits_processors:
            if not callable(processor):
                raise InputError(f"logits_processors must hold callables (context_ids, logits) -> logits, "
                                 f"got {processor!r}")


def bad_words_stage(bad_words_ids, eos: list[int], vocab_size: int) -> NoBadWordsLogitsProcessor:
    """HF's bad-words processor, after checking the ids fit the vocabulary (HF would index out of range)."""
    if not isinstance(bad_words_ids, (list, tuple)) or not all(
            isinstance(word, (list, tuple)) for word in bad_words_ids):
        raise InputError(f"bad_words_ids must be a list of token id lists, got {bad_words_ids!r}")
    for word in bad_words_ids:
        for token in word:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                raise InputError(f"bad_words_ids holds {token!r}, not a token id of this model (0..{vocab_size - 1})")
    return NoBadWordsLogitsProcessor([list(word) for word in bad_words_ids], eos or None)
