"""The second speculation stage shared by `staged` and `cascade`: a draft model that speculates on itself.

A draft model decoding token by token costs one forward per draft token. Here a model-free drafter built from
the context (`ContextNGramModel`: the continuation of the longest earlier match of the context's tail, else a
bigram chain of most frequent followers) proposes tokens *to the draft model*, which checks them in one forward
with the same verifier the target uses: greedy match at temperature 0, speculative sampling against the
deterministic proposal otherwise. So the draft tokens that come out are exactly those the draft model would
produce on its own (same greedy tokens; same distribution when sampling), and each carries the draft
distribution q it was chosen from, which the target's verification needs. Only the number of draft-model
forwards changes: one per stage-two round, each round committing its accepted proposal plus one token.

Worked example, context [.. a b c a b], draft count 4, stage_two_tokens 3:
    round 1: the tail [a b] occurred before, followed by c: propose [c a b]; one draft forward over
             [b(root) c a b] gives 4 rows; the draft model agrees with c and a but wants d after a:
             3 draft tokens [c a d] from 1 forward.
    round 2: 1 token left to make: propose nothing; one forward over [d] gives the 4th token e.
2 draft forwards instead of 4. The draft cache ends holding context + [c a d]: the last token e is fed with
the next forward, as the target's root is.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from accelgen.draft import Draft, Verdict, keep_accepted
from accelgen.drafters.draft_decoding import roll_back
from accelgen.drafters.prompt_lookup import NGramIndex, copy_continuation
from accelgen.errors import InputError
from accelgen.verify import default_verifier
from accelgen.models.engines import runner_for
from accelgen.models.runner import ModelRunner
from accelgen.registry import MethodOptions
from accelgen.sampling import SamplingConfig, logits_to_probs


@dataclass(frozen=True)
class StageTwoOptions(MethodOptions):
    """The second stage's options, which a method drafting through it lists after its own: its options
    dataclass subclasses (StageTwoOptions, ItsOwnOptions), as a dataclass lists its last base's fields first."""

    stage_two_tokens: int = 4  # the second stage's draft length, per draft-model step
    max_ngram: int = 3  # the second stage's longest n-gram


class ContextNGramModel:
    """The cheapest drafter: statistics of the prompt and the committed tokens, no model.

    propose(sequence, length) continues a sequence that extends the observed context (committed context +
    draft tokens not yet verified): first the tokens that followed the most recent earlier occurrence of the
    sequence's last n tokens (n = max_ngram down to 2, copied periodically past the end), else a bigram chain,
    each token the most frequent follower of the one before (ties: the first seen). max_ngram = 1 leaves the
    bigram model alone. Example, observed [7 8 9 7 8 5 7 8], max_ngram 3: [5 7 8] occurs only as the tail, but
    [7 8] also ended at position 5, so it proposes [5 7 8 ..] (copied on periodically); after a token never
    seen before it proposes nothing.
    """

    def __init__(self, max_ngram: int):
        if max_ngram < 1:
            raise InputError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.index = NGramIndex(2, max_ngram)  # empty index when max_ngram is 1
        self.followers: dict[int, Counter] = {}  # token -> counts of the tokens that followed it

    def observe(self, context: list[int]) -> None:
        """Index the tokens of context not seen yet (context extends what was observed before)."""
        if len(context) < len(self.index.tokens):  # a different sequence: start over
            self.index = NGramIndex(2, self.max_ngram)
            self.followers = {}
        new_tokens = context[len(self.index.tokens) :]
        bigrams = self.index.tokens[-1:] + new_tokens  # the last token seen before, then the new ones
        for before, after in zip(bigrams, bigrams[1:]):
            self.followers.setdefault(before, Counter())[after] += 1
        self.index.extend(new_tokens)

    def propose(self, sequence: list[int], length: int) -> list[int]:
        """Up to `length` tokens continuing sequence (it starts with the observed context)."""
        if length <= 0 or not sequence:
            return []
        for n in range(min(self.max_ngram, len(sequence)), 1, -1):
            end = self._most_recent_earlier(self.index.occurrences(tuple(sequence[-n:])), len(sequence))
            if end is not None:
                return copy_continuation(sequence, end, length)
        return self._bigram_chain(sequence[-1], length)

    @staticmethod
    def _most_recent_earlier(ends: list[int], tail_end: int) -> int | None:
        """The last of the increasing end positions `ends` before tail_end (only the tail itself ends there)."""
        for end in reversed(ends[-2:]):
            if end < tail_end:
                return end
        return None

    def _bigram_chain(self, token: int, length: int) -> list[int]:
        chain = []
        while len(chain) < length and token in self.followers:
            token = self.followers[token].most_common(1)[0][0]
            chain.append(token)
        return chain


class SelfSpeculatingDraftModel:
    """A draft model whose own decoding is speculative: `chain` makes its next tokens, exactly as it would
    decode them one by one, in fewer forwards when the n-gram/bigram proposals are right."""

    def __init__(self, draft_model, sampling: SamplingConfig, generator: torch.Generator | None,
                 stage_two_tokens: int, max_ngram: int = 3, verify: Callable | None = None, proposer=None):
        """draft_model: a model, or a ModelRunner over one (`triforce`: the target with a retrieval cache).
        stage_two_tokens: tokens proposed to the draft model per forward (0: it decodes alone).
        verify(draft, draft_logits, generator) -> Verdict: the stage-two rule; by default the target's own.
        proposer: what proposes those tokens (observe(context), propose(sequence, length) -> token ids, each a
        deterministic function of the sequence); by default a ContextNGramModel(max_ngram)."""
        if stage_two_tokens < 0:
            raise InputError(f"stage_two_tokens must be >= 0, got {stage_two_tokens}")
        self.runner = draft_model if isinstance(draft_model, ModelRunner) else runner_for(draft_model)
        self.sampling = sampling
        self.generator = generator
        self.stage_two_tokens = stage_two_tokens
        self.cheap = proposer if proposer is not None else ContextNGramModel(max_ngram)
        self.verify = verify or default_verifier(sampling)
        self.cached_tokens: list[int] = []  # tokens whose KV the draft cache holds, in order
        # counters, for reports: draft_tokens - forwards = draft-model forwards saved by stage two
        self.forwards = 0
        self.draft_tokens = 0
        self.proposed = 0
        self.accepted = 0

    @property
    def max_positions(self) -> int:
        return self.runner.max_positions

    def chain(self, context: list[int], count: int) -> tuple[list[int], torch.Tensor]:
        """The draft model's next `count` tokens after context (count <= its context room), and the
        (count, vocab) float32 logits row each was chosen from (row 0 after context)."""
        self.cheap.observe(context)
        if count <= 0:
            return [], torch.empty(0, self.runner.vocab_size)
        roll_back(self.runner, self.cached_tokens, context)
        sequence, rows = list(context), []
        made = 0
        while made < count:
            # the round makes its accepted proposal + 1 token: propose at most what is still missing, minus 1
            proposal = self.cheap.propose(sequence, min(self.stage_two_tokens, count - made - 1))
            uncached = sequence[self.runner.length :]  # ends with the root, the last token of sequence
            logits = self.runner.forward(torch.tensor(uncached + proposal), logits_for_last=len(proposal) + 1)
            # logits: (len(proposal)+1, vocab), row 0 after the root, row i+1 after proposal[i]
            draft = Draft.chain(torch.tensor(proposal, dtype=torch.long))
            verdict: Verdict = self.verify(draft, logits, self.generator)
            keep_accepted(self.runner, len(sequence) - 1, verdict)
            new_tokens = verdict.new_tokens(draft)
            sequence += new_tokens
            rows.append(logits[: len(new_tokens)])
            made += len(new_tokens)
            self.forwards += 1
            self.proposed += len(proposal)
            self.accepted += len(verdict.accepted)
        self.draft_tokens += count
        self.cached_tokens = sequence[:-1]  # the last token is fed with the next forward
        return sequence[len(context) :], torch.cat(rows)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(n, vocab) draft logits -> the (n, vocab) distributions sampling draws from."""
        return logits_to_probs(logits, self.sampling)

