"""A draft model decoding on its own KV cache: the one token-by-token draft loop, used by `speculative` (and the
methods built on its drafter), `universal` and TriForce's lowest level, and the cache bookkeeping it shares with
the stage-two drafters and the draft trees.

The draft cache follows the committed context: before each proposal it is rolled back to the longest prefix it
shares with the context, so rejected draft tokens are forgotten, and the rest of the context is fed in one
forward. A drafter keeps `cached_tokens`, the tokens whose KV its cache holds, in order; the functions here change
the cache and that list together.

The loops are generators of their draft-model forwards: they yield (runner, token_ids) and are sent back the
(vocab,) logits after them, so a server can run many sequences' drafts in one batched forward
(models/batch.py: forward_together); `forward_alone` runs one sequence's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from accelgen.models.batch import forward_alone
from accelgen.sampling import SamplingConfig, gumbel_choice, logits_to_probs, sample


@dataclass(frozen=True)
class TokenChoice:
    """How the draft model's next token is chosen from its logits, and after which token drafting stops."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # argmax at temperature 0, else a draw
    generator: torch.Generator | None = None
    confidence_threshold: float = 0.0  # stop after a token the draft model itself gives less probability
    greedy_probs: bool = False  # at temperature 0, also record the distribution (softmax at temperature 1)
    stop_tokens: frozenset[int] = frozenset()  # stop after one of these (the draft model's EOS)

    def next_token(self, logits: torch.Tensor, sequence: list[int]) -> tuple[int, torch.Tensor | None, bool]:
        """(token, the (vocab,) distribution recorded for it or None, whether drafting stops after it) at the
        position after sequence (context + tokens drafted so far), from the (vocab,) logits there.

        The logits go through the request's processors with that sequence, as the target's do; when sampling, the
        token is drawn from the distribution it records."""
        if self.sampling.processors is not None:
            logits = self.sampling.processors.row(torch.tensor(sequence), logits)
        if self.sampling.greedy:
            token = int(logits.argmax())
            confidence = float(torch.softmax(logits, -1)[token]) if self.confidence_threshold else 1.0
            probs = torch.softmax(logits, -1) if self.greedy_probs else None
        else:
            probs = logits_to_probs(logits, self.sampling)
            token = self.draw(probs, position=len(sequence))
            confidence = float(probs[token])
        # a draft the draft model itself doubts is likely rejected: stop there (a choice of the draft alone, so
        # verification stays exact)
        return token, probs, confidence < self.confidence_threshold or token in self.stop_tokens

    def draw(self, probs: torch.Tensor, position: int) -> int:
        """A draft token for an absolute position from its (vocab,) sampling probabilities: with the seeded
        per-position noise when there is one (the target's choice there whenever the two models agree), else a
        sample from the generator."""
        noise = self.sampling.noise
        if noise is None:
            return sample(probs, self.generator)
        return int(gumbel_choice(probs[None], noise.at(position)[None])[0])


GREEDY = TokenChoice()


def decode_draft(runner, cached_tokens: list[int], context: list[int], count: int,
                 choice: TokenChoice = GREEDY) -> tuple[list[int], torch.Tensor | None]:
    """decode_draft_steps, its forwards run one at a time."""
    return forward_alone(decode_draft_steps(runner, cached_tokens, context, count, choice))


def decode_draft_steps(runner, cached_tokens: list[int], context: list[int], count: int,
                       choice: TokenChoice = GREEDY):
    """Up to `count` draft tokens after context, one draft-model forward each, chosen by `choice`; fewer where
    the choice stops or the draft model's context (it may be shorter than the target's) has no room.

    runner: the draft model's, its cache holding cached_tokens. Returns (tokens, (len(tokens), vocab) the
    distributions recorded for them, or None when there are none). The cache then holds context + tokens[:-1]:
    the last token needs no forward of its own, the next proposal's catch-up feeds it."""
    count = min(count, runner.max_positions - len(context))
    if count <= 0:
        return [], None
    logits = yield from catch_up_steps(runner, cached_tokens, context)
    sequence, probs = list(context), []
    while True:
        token, token_probs, stop = choice.next_token(logits, sequence)
        sequence.append(token)
        if token_probs is not None:
            probs.append(token_probs)
        if stop or len(sequence) == len(context) + count:
            return sequence[len(context) :], torch.stack(probs) if probs else None
        logits = yield runner, torch.tensor([token])
        cached_tokens.append(token)


def catch_up(runner, cached_tokens: list[int], context: list[int]) -> torch.Tensor:
    """Roll a draft cache holding cached_tokens back to what it shares with context and feed the rest;
    returns the (vocab,) logits after context. At least the last token is always fed, to get its logits."""
    return forward_alone(catch_up_steps(runner, cached_tokens, context))


def catch_up_steps(runner, cached_tokens: list[int], context: list[int]):
    """catch_up as a generator of its one forward; cached_tokens becomes context."""
    shared = roll_back(runner, cached_tokens, context)
    logits = yield runner, torch.tensor(context[shared:])
    cached_tokens.extend(context[shared:])
    return logits


def roll_back(runner, cached_tokens: list[int], context: list[int]) -> int:
    """Keep the longest cached prefix shared with context, short of its last token (cut from cached_tokens too);
    returns its length."""
    shared = shared_prefix(cached_tokens, context)
    runner.keep(shared, [])
    del cached_tokens[shared:]
    return shared


def shared_prefix(cached_tokens: list[int], context: list[int]) -> int:
    """Length of the longest prefix of cached_tokens that context shares, short of context's last token."""
    shared = 0
    limit = min(len(cached_tokens), len(context) - 1)
    while shared < limit and cached_tokens[shared] == context[shared]:
        shared += 1
    return shared
