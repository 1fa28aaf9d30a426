"""SpecInfer (Miao et al. 2023): a token tree from a draft model, verified in one target forward.

The draft model expands a tree (see draft_tree.py). Statically: `branching[d]` children for every node at
depth d, or the tree of the given `paths` (Medusa-style choices, e.g. [[0], [1], [0, 0]]; overrides
branching). Dynamically (`dynamic=True`, as EAGLE-2): the `width` most probable nodes of each level get
`width` children each, for `depth` levels under a budget of `max_nodes`. Greedy decoding keeps the longest
path the target agrees with; sampling uses SpecInfer's multi-step speculative sampling, exact because the
children of a node are drawn i.i.d. from the draft distribution (the default verifier of the loop).
"""

from __future__ import annotations

from accelgen.drafters.draft_model import check_vocabularies
from accelgen.drafters.draft_tree import DraftModelScorer, DraftTreeDrafter
from accelgen.registry import MethodSpec, register


def _make(target_model, *, draft_model, sampling, generator, tokenizer=None, branching, paths, dynamic, width,
          depth, max_nodes):
    check_vocabularies(target_model, draft_model)
    if dynamic:
        return DraftTreeDrafter(DraftModelScorer(draft_model), sampling, generator, width=width, depth=depth,
                                max_nodes=max_nodes)
    return DraftTreeDrafter(DraftModelScorer(draft_model), sampling, generator, branching=branching, paths=paths)


register(
    MethodSpec(
        name="specinfer",
        family="speculative",
        lossless="distribution-exact",
        paper="Miao et al. 2023, arXiv:2305.09781",
        summary="the draft model expands a token tree (static widths, or dynamic by path probability), verified "
                "in one target forward with tree attention; multi-step speculative sampling over i.i.d. siblings",
        make_drafter=_make,
        needs=("draft_model",),
        options={"branching": [2, 2, 1, 1], "paths": [], "dynamic": False, "width": 4, "depth": 5, "max_nodes": 16},
    )
)
