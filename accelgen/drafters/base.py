"""The drafter contract: what every drafter offers the loop (accelgen/loop.py), and what it is built from.

A drafter proposes a Draft for the current context, then hears what was accepted. Its class declares what
else it does (capabilities, read by the loop and the server); the `Drafter` base class gives the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from accelgen.draft import Draft, Verdict
from accelgen.sampling import SamplingConfig


@dataclass(frozen=True)
class BuildContext:
    """What a method's drafter is built from besides its own options: `MethodSpec.drafter.make(build, options)`."""

    target_model: Any  # the target: a transformers model (or a llama.cpp one)
    target: Any = None  # the runner holding the target's KV cache, as the loop feeds it (None outside the loop)
    draft_model: Any = None
    tokenizer: Any = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    generator: torch.Generator | None = None


class Drafter:
    """Base of every drafter. Capabilities, declared as class attributes:

    batches_draft_forwards: the drafter offers `draft_steps(context, max_nodes)`, propose() as a generator of its
        draft-model forwards (see DraftModelDrafter), so that a server runs a whole batch's drafts together.
    drafts_with_target: the drafter drafts from a forward of the target itself (PaSS): instead of calling
        propose, the loop feeds the target the uncached tokens followed by `lookahead(max_nodes)`, (k, d) input
        embeddings, keeps its cache as it was (the prompt before the root kept), and gives the rows to
        `draft_from(logits)`.
    draft_budget: a DraftBudget (accelgen/costs.py) when the drafter already sizes its drafts by the measured
        costs, else None.
    drafts_in_verify: the drafter drafts from the verifying forward itself (BiTA, SPACE: drafters/mask_drafting.py):
        the loop appends `mask_inputs(draft, prefix)`, (a, d) embeddings with their (m + a, m + a) attention
        pattern, after the step's m tokens; the target's own rows are untouched (nothing real attends to them),
        their rows go to `read_masks(draft, verdict, rows)` after verification, and their KV entries are dropped
        with the rejected nodes'. `mask_depth` says how many positions past a node they reach.
    """

    batches_draft_forwards = False
    drafts_with_target = False
    drafts_in_verify = False
    draft_budget = None

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        """A draft continuing context (L,) long (prompt + committed tokens), with at most max_nodes nodes."""
        raise NotImplementedError

    def update(self, draft: Draft, verdict: Verdict, target_logits: torch.Tensor) -> None:
        """Told which nodes of its last draft were accepted, with the target's logits over root + draft,
        (n+1, vocab) float32 (row 0 the root, row i+1 node i): adapt draft length, caches, n-gram pools."""

    def close(self) -> None:
        """Release what the drafter holds for this request (e.g. a shared trie's prompt branches)."""

    def describe(self) -> dict | None:
        """What the drafter chose, and why (a policy such as `auto`), for the result's stats; None: nothing."""
        return None


class ContextCursor:
    """What is new in a request's context since the drafter last read it: only the new tokens leave the tensor,
    so that reading costs what a step adds, not the context so far. `tokens` holds everything read, as a list.

    Within a request the context only grows; a shorter one is another request's, read from its start."""

    def __init__(self):
        self.tokens: list[int] = []

    def new_since_last(self, context: torch.Tensor) -> list[int]:
        """context: (L,) long. The tokens appended since the last call (all of them at first or after a restart)."""
        if len(context) < len(self.tokens):
            self.tokens = []
        new = context[len(self.tokens) :].tolist()
        self.tokens.extend(new)
        return new

