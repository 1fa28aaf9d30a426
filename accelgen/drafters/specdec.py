"""SpecDec's Spec-Verification (Xia et al. 2023, arXiv:2203.16487) on draft-model drafts: lossy by design.

Drafting is the `speculative` method's: the draft model proposes `gamma` tokens greedily. Verification is
relaxed (verify/specdec.py): a drafted token is accepted when it is among the target's top-`beta` tokens and its
log-probability is within `tau` of the top-1's, so more of the draft survives at some cost in agreement with
greedy decoding. beta = 1 is exactly greedy decoding. (The paper's own drafter is a trained
non-autoregressive model; any chain drafter fits the rule.) Greedy decoding only.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelgen.drafters.draft_model import GammaOptions, make_gamma_drafter
from accelgen.registry import MethodOptions, MethodSpec, Part, register
from accelgen.verify import check_specdec_options, greedy_rule_verifier, verify_specdec


@dataclass(frozen=True)
class SpecVerificationOptions(MethodOptions):
    beta: int = 3  # drafted tokens among the target's top-beta pass ...
    tau: float = 1.0  # ... if within tau of the top-1 log-probability

    def __post_init__(self):
        check_specdec_options(self.beta, self.tau)


register(
    MethodSpec(
        name="specdec",
        family="speculative",
        lossless="lossy",
        paper="Xia et al. 2023, arXiv:2203.16487",
        summary="draft-model drafts with Spec-Verification: a drafted token is accepted if it is in the target's "
                "top-beta and within tau of the top-1 log-probability (beta=1: greedy)",
        drafter=Part(make_gamma_drafter, GammaOptions),
        needs=("draft_model",),
        verifier=Part(greedy_rule_verifier(verify_specdec, "beta", "tau"), SpecVerificationOptions),
        greedy_only=True,
    )
)
