"""Multi-candidate speculative decoding (Yang et al. 2024, arXiv:2401.06706).

The draft model samples `branching[d]` candidates for every node at depth d; the candidates share their
prefixes' KV through the token tree and are verified in one target forward. With `replacement=True` the
candidates are i.i.d. and the multi-candidate rule is SpecInfer's multi-step speculative sampling; without
replacement (the default: no slot is wasted on a duplicate) each candidate is judged against the draft
distribution with the earlier candidates removed (verify/multi_candidate.py). Greedy decoding drafts the
top-k tokens and keeps the longest path the target agrees with.
"""

from __future__ import annotations

from accelgen.drafters.draft_model import check_vocabularies
from accelgen.drafters.draft_tree import DraftModelScorer, DraftTreeDrafter
from accelgen.verify import default_verifier
from accelgen.registry import MethodSpec, register
from accelgen.sampling import logits_to_probs
from accelgen.verify import verify_without_replacement


def _make(target_model, *, draft_model, sampling, generator, tokenizer=None, branching, replacement):
    check_vocabularies(target_model, draft_model)
    return DraftTreeDrafter(DraftModelScorer(draft_model), sampling, generator, branching=branching,
                            replacement=replacement)


def _make_verifier(sampling, *, replacement, **_options):
    if sampling.greedy or replacement:
        return default_verifier(sampling)
    return lambda draft, target_logits, generator: verify_without_replacement(
        draft, logits_to_probs(target_logits, sampling), generator)


register(
    MethodSpec(
        name="mcsd",
        family="speculative",
        lossless="distribution-exact",
        paper="Yang et al. 2024, arXiv:2401.06706",
        summary="the draft model samples several candidates per position (with or without replacement), sharing "
                "prefixes in a token tree; verified with the multi-candidate rule",
        make_drafter=_make,
        needs=("draft_model",),
        options={"branching": [4, 2, 1, 1], "replacement": False},
        make_verifier=_make_verifier,
    )
)
