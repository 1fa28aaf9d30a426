"""Speculative contrastive decoding (Yuan et al. 2023, arXiv:2311.08981), greedy: lossy by design.

The draft model is the amateur: it drafts `gamma` tokens greedily, as in `speculative`, and its drafts carry
its full distribution at every drafted position (draft_probs). The target is the expert; verification
(verify/contrastive.py) accepts drafted tokens while they equal the argmax of the contrastive score
expert logits - alpha * amateur log-probabilities over the plausible tokens (expert probability >= beta * the
expert's best). alpha = 0 is exactly greedy decoding. Greedy decoding only.
"""

from __future__ import annotations

from accelgen.drafters.draft_model import DraftModelDrafter, check_vocabularies
from accelgen.registry import MethodSpec, register
from accelgen.verify import check_contrastive_options, verify_contrastive


def _make(target_model, *, draft_model, sampling, generator, tokenizer=None, gamma, alpha, beta):
    check_vocabularies(target_model, draft_model)
    return DraftModelDrafter(draft_model, sampling, generator, gamma=gamma, greedy_draft_probs=True)


def _make_verifier(sampling, *, gamma, alpha, beta):
    check_contrastive_options(alpha, beta)
    return lambda draft, target_logits, generator: verify_contrastive(draft, target_logits, alpha, beta)


register(
    MethodSpec(
        name="contrastive",
        family="speculative",
        lossless="lossy",
        paper="Yuan et al. 2023, arXiv:2311.08981",
        summary="the draft model (amateur) drafts; tokens are accepted while they are the argmax of the contrastive "
                "score expert logits - alpha * amateur log-probs over plausible tokens (alpha=0: greedy)",
        make_drafter=_make,
        needs=("draft_model",),
        options={"gamma": 5, "alpha": 0.5, "beta": 0.1},
        make_verifier=_make_verifier,
        greedy_only=True,
    )
)
