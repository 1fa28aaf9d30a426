"""Big Little Decoder (Kim et al. 2023, arXiv:2302.07863), greedy: lossy by design.

Fallback: the small (draft) model generates greedily while it is confident; when its top probability drops
below `fallback_threshold` (or after `max_draft` tokens) it hands over, and the unsure token is not drafted:
the large model picks that one. Rollback: the large model scores the small model's tokens in one forward and
rolls back from the first token whose cross-entropy under the large model exceeds `rollback_threshold`
(verify/bild.py), committing its own token there. rollback_threshold = 0 is exactly greedy decoding.
Greedy decoding only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelgen.draft import Draft
from accelgen.drafters.base import BuildContext, Drafter
from accelgen.drafters.draft_model import DraftModelDrafter, draft_model_drafter
from accelgen.errors import InputError
from accelgen.registry import MethodOptions, MethodSpec, Part, register
from accelgen.verify import greedy_rule_verifier, verify_bild


class FallbackDrafter(Drafter):
    """Greedy drafts that end where the draft model's confidence (its top probability) first drops below
    fallback_threshold, that token excluded, or after max_draft tokens."""

    def __init__(self, draft_model, sampling, generator, *, fallback_threshold: float, max_draft: int):
        # the speculative drafter stops right after the first unsure token; propose() drops that token
        self.drafter = DraftModelDrafter(draft_model, sampling, generator, gamma=max_draft,
                                         confidence_threshold=fallback_threshold, greedy_draft_probs=True)
        self.fallback_threshold = fallback_threshold

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        draft = self.drafter.propose(context, max_nodes)
        if len(draft) and float(draft.draft_probs[-1].max()) < self.fallback_threshold:
            draft = draft.truncated(len(draft) - 1)
        return draft

    def update(self, draft, verdict, target_logits) -> None:
        self.drafter.update(draft, verdict, target_logits)


@dataclass(frozen=True)
class FallbackOptions(MethodOptions):
    fallback_threshold: float = 0.5  # the small model hands over below this top probability ...
    max_draft: int = 8  # ... or after this many tokens

    def __post_init__(self):
        if isinstance(self.fallback_threshold, bool) or not isinstance(self.fallback_threshold, (int, float)) \
                or not 0 <= self.fallback_threshold <= 1:
            raise InputError(f"bild: fallback_threshold (a probability) must be in [0, 1], got "
                             f"{self.fallback_threshold!r}")
        if isinstance(self.max_draft, bool) or not isinstance(self.max_draft, int) or self.max_draft < 1:
            raise InputError(f"bild: max_draft must be an integer >= 1, got {self.max_draft!r}")


@dataclass(frozen=True)
class RollbackOptions(MethodOptions):
    rollback_threshold: float = 2.0  # the large model rolls back from a token whose cross-entropy exceeds this

    def __post_init__(self):
        if isinstance(self.rollback_threshold, bool) or not isinstance(self.rollback_threshold, (int, float)) \
                or not self.rollback_threshold >= 0:
            raise InputError(f"bild: rollback_threshold (a cross-entropy) must be a number >= 0, got "
                             f"{self.rollback_threshold!r}")


def _make(build: BuildContext, options: FallbackOptions) -> FallbackDrafter:
    return draft_model_drafter(build, FallbackDrafter, **options.as_dict())


register(
    MethodSpec(
        name="bild",
        family="speculative",
        lossless="lossy",
        paper="Kim et al. 2023, arXiv:2302.07863",
        summary="the small model drafts until its confidence drops below fallback_threshold; the large model rolls "
                "back tokens whose cross-entropy exceeds rollback_threshold (0: greedy)",
        drafter=Part(_make, FallbackOptions),
        needs=("draft_model",),
        verifier=Part(greedy_rule_verifier(verify_bild, "rollback_threshold"), RollbackOptions),
        greedy_only=True,
    )
)
