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
from accelgen.drafters.draft_model import check_vocabularies
from accelgen.drafters.draft_tree import DraftModelScorer, DraftTreeDrafter
from accelgen.registry import MethodOptions, MethodSpec, Part, register
from accelgen.verify import exact_rule_verifier, verify_spectr


@dataclass(frozen=True)
class SpecTrOptions(MethodOptions):
    num_drafts: int = 4  # independent draft sequences
    gamma: int = 4  # tokens in each

    def __post_init__(self):
        for name, value in (("num_drafts", self.num_drafts), ("gamma", self.gamma)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"spectr: {name} must be an integer >= 1, got {value!r}")


def _make(build: BuildContext, options: SpecTrOptions) -> DraftTreeDrafter:
    check_vocabularies(build.target_model, build.draft_model)
    # K-SEQ needs i.i.d. sequences: duplicates included
    return DraftTreeDrafter(DraftModelScorer(build.draft_model), build.sampling, build.generator,
                            branching=[options.num_drafts] + [1] * (options.gamma - 1), replacement=True)


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
        verifier=Part(exact_rule_verifier(verify_spectr)),
    )
)
