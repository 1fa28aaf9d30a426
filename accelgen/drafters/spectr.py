"""SpecTr (Sun et al. 2023, arXiv:2310.15141): K i.i.d. draft sequences, one selected exactly by K-SEQ.

The draft model samples `num_drafts` independent sequences of `gamma` tokens: a token tree whose root has
`num_drafts` children drawn i.i.d. from the draft distribution, each continued by a chain of one child per
level (draft_tree.py, branching [num_drafts, 1, ..., 1], with replacement). The target scores all of them in
one forward and K-SEQ (verify/spectr.py) selects a token at each depth so that the output follows the target
distribution exactly. At temperature 0 the root gets the draft's top-`num_drafts` tokens, each continued
greedily, and greedy matching keeps the longest path the target agrees with.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelgen.drafters.base import BuildContext
from accelgen.drafters.budget import AUTO_LENGTH, draft_length
from accelgen.drafters.draft_model import check_vocabularies
from accelgen.drafters.draft_tree import DraftModelScorer, DraftTreeDrafter
from accelgen.errors import InputError
from accelgen.registry import MethodOptions, MethodSpec, Part, register
from accelgen.verify import exact_rule_verifier, verify_spectr

USUAL_GAMMA = 4  # tokens in each draft sequence with gamma="auto"


@dataclass(frozen=True)
class SpecTrOptions(MethodOptions):
    num_drafts: int = 4  # independent draft sequences
    gamma: int | str = AUTO_LENGTH  # tokens in each (AUTO_LENGTH: USUAL_GAMMA, capped by the measured costs)

    def __post_init__(self):
        if isinstance(self.num_drafts, bool) or not isinstance(self.num_drafts, int) or self.num_drafts < 1:
            raise InputError(f"spectr: num_drafts must be an integer >= 1, got {self.num_drafts!r}")
        draft_length(self.gamma, USUAL_GAMMA, "spectr: gamma")


def _make(build: BuildContext, options: SpecTrOptions) -> DraftTreeDrafter:
    check_vocabularies(build.target_model, build.draft_model)
    # K-SEQ needs i.i.d. sequences: duplicates included
    return DraftTreeDrafter(DraftModelScorer(build.draft_model), build.sampling, build.generator,
                            branching=[options.num_drafts] + [1] * (draft_length(options.gamma, USUAL_GAMMA) - 1),
                            replacement=True)


register(
    MethodSpec(
        name="spectr",
        family="speculative",
        lossless="distribution-exact",
        paper="Sun et al. 2023, arXiv:2310.15141",
        summary="the draft model samples num_drafts independent sequences; K-SEQ (optimal transport with membership "
                "cost, approximated) selects one token per depth exactly from the target distribution",
        drafter=Part(_make, SpecTrOptions),
        needs=("draft_model",),
        pytorch_draft=True,  # DraftModelScorer: the draft expands the tree level by level
        verifier=Part(exact_rule_verifier(verify_spectr)),
        draft_budget="measured",  # drafts capped by the measured costs unless the request fixes their length
    )
)
