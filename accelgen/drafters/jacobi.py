"""Jacobi decoding (Santilli et al. 2023): parallel fixed-point iteration over a block of guessed tokens.

Greedy decoding solves y_i = argmax p(y_i | y_<i) for every position i of a block, one after the other.
Jacobi iteration updates all positions at once from the previous guess: y_i <- argmax p(y_i | guess_<i).
Positions whose prefix is already right become right and stay right, so the block reaches the greedy
output (the fixed point) in at most block_size iterations, usually fewer.

Here one iteration is one step of the loop: the draft is the current guess block as a chain; the target's
logits over it (row i predicts the token after node i) are the next iterate. Verification accepts the guess
tokens that already equal the fixed point plus one token of the target's own, so at least one token is
committed per step and the output is exactly greedy decoding's, whatever the guesses; the rest of the iterate
becomes the next guess block, padded with the last token.

Drafts are deterministic functions of what was already scored, so with speculative sampling they are point
masses and the method is exact for sampling too (the guesses are greedy, so they match samples less often).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelgen.draft import Draft, Verdict
from accelgen.drafters.base import BuildContext, Drafter
from accelgen.errors import InputError
from accelgen.registry import MethodOptions, MethodSpec, Part, register


def next_guess(target_logits: torch.Tensor, accepted: int) -> list[int]:
    """The next iterate after the committed tokens, from the logits over root + a chain draft.

    target_logits: (n+1, vocab); row i predicts the token after node i - 1 (row 0: after the root). The step
    commits `accepted` draft tokens and then the token of row `accepted`; rows accepted+1.. predict the positions
    after that, conditioned on guesses that were (at least partly) wrong: exactly the Jacobi update.
    Example, n = 4, 1 accepted: committed g1 and argmax(row 1); next guess = argmax(rows 2, 3, 4).
    """
    return target_logits[accepted + 1 :].argmax(dim=-1).tolist()


class JacobiDrafter(Drafter):
    def __init__(self, block_size: int = 8):
        if block_size < 1:
            raise InputError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.guess: list[int] = []  # the current iterate for the positions after the root

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        """context: (L,) long; only its last token is read (to pad a short guess)."""
        size = min(self.block_size, max_nodes)
        guess = self.guess[:size]
        padding = guess[-1] if guess else int(context[-1])
        return Draft.chain(torch.tensor(guess + [padding] * (size - len(guess)), dtype=torch.long))

    def update(self, draft: Draft, verdict: Verdict, target_logits: torch.Tensor) -> None:
        self.guess = next_guess(target_logits, len(verdict.accepted))


@dataclass(frozen=True)
class JacobiOptions(MethodOptions):
    block_size: int = 8  # guesses iterated per step


def _make(build: BuildContext, options: JacobiOptions) -> JacobiDrafter:
    return JacobiDrafter(options.block_size)


register(
    MethodSpec(
        name="jacobi",
        family="parallel",
        lossless="distribution-exact",
        paper="Santilli et al. 2023, arXiv:2305.10427",
        summary="parallel fixed-point (Jacobi) iteration over a block of guesses; each step keeps the converged prefix",
        drafter=Part(_make, JacobiOptions),
    )
)
