"""SpecDec's Spec-Verification (Xia et al. 2023, arXiv:2203.16487) on draft-model drafts: lossy by design.

Drafting is the `speculative` method's: the draft model proposes `gamma` tokens greedily. Verification is
relaxed (verify/specdec.py): a drafted token is accepted when it is among the target's top-`beta` tokens and its
log-probability is within `tau` of the top-1's, so more of the draft survives at some cost in agreement with
greedy decoding. beta = 1 is exactly greedy decoding. (The paper's own drafter is a trained
non-autoregressive model; any chain drafter fits the rule.) Greedy decoding only.
"""

from __future__ import annotations

from accelgen.drafters.draft_model import DraftModelDrafter, check_vocabularies
from accelgen.registry import MethodSpec, register
from accelgen.verify import check_specdec_options, verify_specdec


def _make(target_model, *, draft_model, sampling, generator, tokenizer=None, gamma, beta, tau):
    check_vocabularies(target_model, draft_model)
    return DraftModelDrafter(draft_model, sampling, generator, gamma=gamma)


def _make_verifier(sampling, *, gamma, beta, tau):
    check_specdec_options(beta, tau)
    return lambda draft, target_logits, generator: verify_specdec(draft, target_logits, beta, tau)


register(
    MethodSpec(
        name="specdec",
        family="speculative",
        lossless="lossy",
        paper="Xia et al. 2023, arXiv:2203.16487",
        summary="draft-model drafts with Spec-Verification: a drafted token is accepted if it is in the target's "
                "top-beta and within tau of the top-1 log-probability (beta=1: greedy)",
        make_drafter=_make,
        needs=("draft_model",),
        options={"gamma": 5, "beta": 3, "tau": 1.0},
        make_verifier=_make_verifier,
        greedy_only=True,
    )
)
