"""The drafter protocol: propose a Draft for the current context, then hear what was accepted."""

from __future__ import annotations

from typing import Protocol

import torch

from accelgen.draft import Draft, Verdict


class Drafter(Protocol):
    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        """A draft continuing context (L,) long (prompt + committed tokens), with at most max_nodes nodes."""
        ...

    def update(self, draft: Draft, verdict: Verdict, target_logits: torch.Tensor) -> None:
        """Told which nodes of its last draft were accepted, with the target's logits over root + draft,
        (n+1, vocab) float32 (row 0 the root, row i+1 node i): adapt draft length, caches, n-gram pools."""
        ...
