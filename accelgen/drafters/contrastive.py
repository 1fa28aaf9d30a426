"""Speculative contrastive decoding (Yuan et al. 2023, arXiv:2311.08981), greedy: lossy by design.

The draft model is the amateur: it drafts `gamma` tokens greedily, as in `speculative`, and its drafts carry
its full distribution at every drafted position (draft_probs). The target is the expert; verification
(verify/contrastive.py) accepts drafted tokens while they equal the argmax of the contrastive score
expert logits - alpha * amateur log-probabilities over the plausible tokens (expert probability >= beta * the
expert's best). alpha = 0 is exactly greedy decoding. Greedy decoding only.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelgen.drafters.base import BuildContext
from accelgen.drafters.draft_model import DraftModelDrafter, GammaOptions, draft_model_drafter
from accelgen.registry import MethodOptions, MethodSpec, Part, register
from accelgen.verify import check_contrastive_options, greedy_rule_verifier, verify_contrastive


@dataclass(frozen=True)
class ContrastiveOptions(MethodOptions):
    alpha: float = 0.5  # the amateur's weight
    beta: float = 0.1  # plausibility cut-off: tokens the expert gives at least beta times its top probability

    def __post_init__(self):
        check_contrastive_options(self.alpha, self.beta)


def _make(build: BuildContext, options: GammaOptions) -> DraftModelDrafter:
    return draft_model_drafter(build, gamma=options.gamma, greedy_draft_probs=True)  # the amateur's distributions


register(
    MethodSpec(
        name="contrastive",
        family="speculative",
        lossless="lossy",
        paper="Yuan et al. 2023, arXiv:2311.08981",
        summary="the draft model (amateur) drafts; tokens are accepted while they are the argmax of the contrastive "
                "score expert logits - alpha * amateur log-probs over plausible tokens (alpha=0: greedy)",
        drafter=Part(_make, GammaOptions),
        needs=("draft_model",),
        verifier=Part(greedy_rule_verifier(verify_contrastive, "alpha", "beta"), ContrastiveOptions),
        greedy_only=True,
    )
)
