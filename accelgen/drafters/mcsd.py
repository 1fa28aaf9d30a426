"""Multi-candidate speculative decoding (Yang et al. 2024, arXiv:2401.06706).

The draft model samples `branching[d]` candidates for every node at depth d; the candidates share their
prefixes' KV through the token tree and are verified in one target forward. With `replacement=True` the
candidates are i.i.d. and the multi-candidate rule is SpecInfer's multi-step speculative sampling; without
replacement (the default: no slot is wasted on a duplicate) each candidate is judged against the draft
distribution with the earlier candidates removed (verify/multi_candidate.py). Greedy decoding drafts the
top-k tokens and keeps the longest path the target agrees with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from accelgen.drafters.base import BuildContext
from accelgen.drafters.draft_model import check_vocabularies
from accelgen.drafters.draft_tree import DraftModelScorer, DraftTreeDrafter
from accelgen.models.layouts import check_tree_positions
from accelgen.verify import default_verifier
from accelgen.registry import MethodOptions, MethodSpec, Part, register
from accelgen.sampling import SamplingConfig, logits_to_probs
from accelgen.verify import verify_without_replacement


@dataclass(frozen=True)
class ReplacementOptions(MethodOptions):
    replacement: bool = False  # candidates drawn with replacement (i.i.d.), or without


@dataclass(frozen=True)
class McsdOptions(MethodOptions):
    branching: list[int] = field(default_factory=lambda: [4, 2, 1, 1])  # candidates per node by depth
    replacement: bool = False  # (the verifier's too)


def _make(build: BuildContext, options: McsdOptions) -> DraftTreeDrafter:
    check_vocabularies(build.target_model, build.draft_model)
    check_tree_positions(build.target_model.config)  # at the start: a measured budget may draft its first tree late
    return DraftTreeDrafter(DraftModelScorer(build.draft_model), build.sampling, build.generator,
                            branching=options.branching, replacement=options.replacement)


def _make_verifier(sampling: SamplingConfig, options: ReplacementOptions):
    if sampling.greedy or options.replacement:
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
        drafter=Part(_make, McsdOptions),
        needs=("draft_model",),
        pytorch_draft=True,  # DraftModelScorer: the draft expands the tree level by level
        verifier=Part(_make_verifier, ReplacementOptions),
        draft_budget="measured",  # drafts capped by the measured costs unless the request fixes their length
    )
)
