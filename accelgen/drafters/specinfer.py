"""SpecInfer (Miao et al. 2023): a token tree from a draft model, verified in one target forward.

The draft model expands a tree (see draft_tree.py). Statically: `branching[d]` children for every node at
depth d, or the tree of the given `paths` (Medusa-style choices, e.g. [[0], [1], [0, 0]]; overrides
branching). Dynamically (`dynamic=True`, as EAGLE-2): the `width` most probable nodes of each level get
`width` children each, for `depth` levels under a budget of `max_nodes`. Greedy decoding keeps the longest
path the target agrees with; sampling uses SpecInfer's multi-step speculative sampling, exact because the
children of a node are drawn i.i.d. from the draft distribution (the default verifier of the loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from accelgen.drafters.base import BuildContext
from accelgen.drafters.draft_model import check_vocabularies
from accelgen.drafters.draft_tree import DraftModelScorer, DraftTreeDrafter
from accelgen.models.layouts import check_tree_positions
from accelgen.registry import MethodOptions, MethodSpec, Part, register


@dataclass(frozen=True)
class SpecInferOptions(MethodOptions):
    branching: list[int] = field(default_factory=lambda: [2, 2, 1, 1])  # static tree: children per node by depth
    paths: list[list[int]] = field(default_factory=list)  # static tree: its paths (overrides branching)
    dynamic: bool = False  # dynamic tree, by path probability:
    width: int = 4
    depth: int = 5
    max_nodes: int = 16


def _make(build: BuildContext, options: SpecInferOptions) -> DraftTreeDrafter:
    check_vocabularies(build.target_model, build.draft_model)
    check_tree_positions(build.target_model.config)  # at the start: a measured budget may draft its first tree late
    scorer = DraftModelScorer(build.draft_model)
    if options.dynamic:
        return DraftTreeDrafter(scorer, build.sampling, build.generator, width=options.width, depth=options.depth,
                                max_nodes=options.max_nodes)
    return DraftTreeDrafter(scorer, build.sampling, build.generator, branching=options.branching, paths=options.paths)


register(
    MethodSpec(
        name="specinfer",
        family="speculative",
        lossless="distribution-exact",
        paper="Miao et al. 2023, arXiv:2305.09781",
        summary="the draft model expands a token tree (static widths, or dynamic by path probability), verified "
                "in one target forward with tree attention; multi-step speculative sampling over i.i.d. siblings",
        drafter=Part(_make, SpecInferOptions),
        needs=("draft_model",),
        pytorch_draft=True,  # DraftModelScorer: the draft expands the tree level by level
        draft_budget="measured",  # drafts capped by the measured costs unless the request fixes their length
    )
)
