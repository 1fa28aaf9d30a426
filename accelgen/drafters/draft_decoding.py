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

from accelgen.draft import to_device
from accelgen.models.batch import forward_alone
from accelgen.sampling import SamplingConfig, draw, gumbel_choice, logits_to_probs


@dataclass(frozen=True)
class TokenChoice:
    """How the draft model's next token is chosen from its logits, and after which token drafting stops."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # argmax at temperature 0, else a draw
    generator: torch.Generator | None = None
    confidence_threshold: float = 0.0  # stop after a token the draft model itself gives less probability
    greedy_probs: bool = False  # at temperature 0, also record the distribution (softmax at temperature 1)
    stop_tokens: frozenset[int] = frozenset()  # stop after one of these (the draft model's EOS)

    @property
    def stops_early(self) -> bool:
        """Whether drafting may end where the draft model doubts its token: then the loop reads each token's check
        back, one host read a token, the price of skipping the forwards after it. (A stop token costs no read: the
        draft runs on past it, rare as it is, and is cut after it once its tokens are read.)"""
        return self.confidence_threshold > 0

    def kept(self, tokens: list[int]) -> int:
        """How many of the drafted tokens to keep: up to and with the first stop token."""
        return next((i + 1 for i, token in enumerate(tokens) if token in self.stop_tokens), len(tokens))

    def next_token(self, logits: torch.Tensor, sequence: torch.Tensor | None,
                   position: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The draft token at absolute `position` from the (vocab,) logits there, all left on the logits' device:
        (token (1,) long, the (vocab,) distribution recorded for it or None, (1,) bool whether the draft model doubts
        it, drafting stopping after it, or None when the choice never stops early).

        sequence: (position,) long, context + tokens drafted so far, for the request's processors (None without):
        the logits go through them with that sequence, as the target's do; when sampling, the token is drawn from
        the distribution it records."""
        if self.sampling.processors is not None:
            logits = self.sampling.processors.row(sequence, logits)
        if self.sampling.greedy:
            token = logits.argmax(dim=-1, keepdim=True)
            probs = torch.softmax(logits, -1) if self.greedy_probs or self.confidence_threshold else None
            recorded = probs if self.greedy_probs else None
        else:
            probs = recorded = logits_to_probs(logits, self.sampling)
            token = self.draw(probs, position)
        if not self.stops_early:
            return token, recorded, None
        # a draft the draft model itself doubts is likely rejected: stop there (a choice of the draft alone, so
        # verification stays exact)
        return token, recorded, probs.gather(0, token) < self.confidence_threshold

    def draw(self, probs: torch.Tensor, position: int) -> torch.Tensor:
        """(1,) long: a draft token for an absolute position from its (vocab,) sampling probabilities, on their
        device: with the seeded per-position noise when there is one (the target's choice there whenever the two
        models agree), else a sample from the generator."""
        noise = self.sampling.noise
        if noise is None:
            return draw(probs[None], self.generator)
        return gumbel_choice(probs[None], noise.at(position, like=probs))


GREEDY = TokenChoice()


def decode_draft(runner, cached_tokens: list[int], context: list[int], count: int,
                 choice: TokenChoice = GREEDY) -> tuple[list[int], torch.Tensor | None]:
    """decode_draft_steps, its forwards run one at a time."""
    return forward_alone(decode_draft_steps(runner, cached_tokens, context, count, choice))


def decode_draft_steps(runner, cached_tokens: list[int], context: list[int], count: int,
                       choice: TokenChoice = GREEDY):
    """Up to `count` draft tokens after context, one draft-model forward each, chosen by `choice`; fewer where
    the choice stops or the draft model's context (it may be shorter than the target's) has no room.

    Each token stays on the device and is fed back as the next forward's input; the tokens are read back once,
    at the end (and a choice that stops early reads its check each token).

    runner: the draft model's, its cache holding cached_tokens. Returns (tokens, (len(tokens), vocab) the
    distributions recorded for them, or None when there are none). The cache then holds context + the drafted
    tokens but the last (past a stop token too: the next proposal's catch-up rolls them back); the last needs no
    forward of its own, the next proposal's catch-up feeds it."""
    count = min(count, runner.max_positions - len(context))
    if count <= 0:
        return [], None
    logits = yield from catch_up_steps(runner, cached_tokens, context)
    # (L,) the context where the logits are, for the request's processors (None: no processors)
    context_ids = None if choice.sampling.processors is None else to_device(context, logits.device)
    drafted, probs = [], []  # (1,) long tokens and (vocab,) distributions, on the device
    while True:
        sequence = None if context_ids is None else torch.cat([context_ids, *drafted])
        token, token_probs, stop = choice.next_token(logits, sequence, position=len(context) + len(drafted))
        drafted.append(token)
        if token_probs is not None:
            probs.append(token_probs)
        if len(drafted) == count or (stop is not None and bool(stop)):
            break
        logits = yield runner, token
    tokens = torch.cat(drafted).tolist()  # the draft's one host read
    cached_tokens.extend(tokens[:-1])  # every token but the last was fed
    kept = choice.kept(tokens)
    return tokens[:kept], torch.stack(probs[:kept]) if probs else None


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
