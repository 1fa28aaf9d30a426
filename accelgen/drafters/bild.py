"""Big Little Decoder (Kim et al. 2023, arXiv:2302.07863), greedy: lossy by design.

Fallback: the small (draft) model generates greedily while it is confident; when its top probability drops
below `fallback_threshold` (or after `max_draft` tokens) it hands over, and the unsure token is not drafted:
the large model picks that one. Rollback: the large model scores the small model's tokens in one forward and
rolls back from the first token whose cross-entropy under the large model exceeds `rollback_threshold`
(verify/bild.py), committing its own token there. rollback_threshold = 0 is exactly greedy decoding.
Greedy decoding only.
"""

from __future__ import annotations

import torch

from accelgen.draft import Draft
from accelgen.drafters.draft_model import DraftModelDrafter, check_vocabularies
from accelgen.registry import MethodSpec, register
from accelgen.verify import verify_bild


class FallbackDrafter:
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


def _check(fallback_threshold, rollback_threshold, max_draft) -> None:
    if isinstance(fallback_threshold, bool) or not isinstance(fallback_threshold, (int, float)) \
            or not 0 <= fallback_threshold <= 1:
        raise ValueError(f"bild: fallback_threshold (a probability) must be in [0, 1], got {fallback_threshold!r}")
    if isinstance(rollback_threshold, bool) or not isinstance(rollback_threshold, (int, float)) \
            or not rollback_threshold >= 0:
        raise ValueError(f"bild: rollback_threshold (a cross-entropy) must be a number >= 0, got {rollback_threshold!r}")
    if isinstance(max_draft, bool) or not isinstance(max_draft, int) or max_draft < 1:
        raise ValueError(f"bild: max_draft must be an integer >= 1, got {max_draft!r}")


def _make(target_model, *, draft_model, sampling, generator, tokenizer=None, fallback_threshold, rollback_threshold,
          max_draft):
    _check(fallback_threshold, rollback_threshold, max_draft)
    check_vocabularies(target_model, draft_model)
    return FallbackDrafter(draft_model, sampling, generator, fallback_threshold=fallback_threshold, max_draft=max_draft)


def _make_verifier(sampling, *, fallback_threshold, rollback_threshold, max_draft):
    _check(fallback_threshold, rollback_threshold, max_draft)
    return lambda draft, target_logits, generator: verify_bild(draft, target_logits, rollback_threshold)


register(
    MethodSpec(
        name="bild",
        family="speculative",
        lossless="lossy",
        paper="Kim et al. 2023, arXiv:2302.07863",
        summary="the small model drafts until its confidence drops below fallback_threshold; the large model rolls "
                "back tokens whose cross-entropy exceeds rollback_threshold (0: greedy)",
        make_drafter=_make,
        needs=("draft_model",),
        options={"fallback_threshold": 0.5, "rollback_threshold": 2.0, "max_draft": 8},
        make_verifier=_make_verifier,
        greedy_only=True,
    )
)
