"""DistillSpec (Zhou et al. 2023, arXiv:2310.08461): speculative decoding with a draft model distilled
toward this target by `accelgen train distillspec` (train/distill.py).

Drafting and verification are `speculative`'s own (DraftModelDrafter, speculative sampling or greedy match),
so the output is the target's exactly; distillation only makes more drafts pass. The method refuses a draft
that was not distilled for this target: `distillspec.json` beside the draft's weights names the target, and
its fingerprint (a hash of the target's first embedding rows) must match the target being decoded.
"""

from __future__ import annotations

import json

from accelgen.drafters.draft_model import DRAFTING_OPTIONS, DraftModelDrafter, check_vocabularies, scheduled
from accelgen.models.loading import beside_weights
from accelgen.registry import MethodSpec, register
from accelgen.train.distill import DISTILLSPEC_FILE, model_fingerprint

HOW_TO_DISTILL = "accelgen train distillspec --model TARGET --draft DRAFT --out FOLDER"


def check_distilled(target_model, draft_model) -> dict:
    """The draft's distillspec.json, after checking that it was distilled for this target; else a ValueError."""
    path = beside_weights(draft_model, DISTILLSPEC_FILE)
    if path is None or not path.is_file():
        raise ValueError(f"distillspec needs a draft distilled for this target, with {DISTILLSPEC_FILE} beside its "
                         f"weights; this draft has none. Distill one with `{HOW_TO_DISTILL}` and pass --draft FOLDER "
                         "(or use --method speculative for an undistilled draft)")
    info = json.loads(path.read_text())
    if info.get("target_fingerprint") != model_fingerprint(target_model):
        raise ValueError(f"this draft was distilled for {info.get('target')!r}, not for this target; distill one for "
                         f"it with `{HOW_TO_DISTILL}`")
    return info


def _make(target_model, *, draft_model, sampling, generator, tokenizer=None, **options):
    check_vocabularies(target_model, draft_model)
    check_distilled(target_model, draft_model)
    return scheduled(DraftModelDrafter(draft_model, sampling, generator, **options), target_model, draft_model)


register(
    MethodSpec(
        name="distillspec",
        family="speculative",
        lossless="distribution-exact",
        paper="Zhou et al. 2023, arXiv:2310.08461",
        summary="speculative decoding with a draft distilled on its own generations toward this target "
                "(`accelgen train distillspec`)",
        make_drafter=_make,
        needs=("draft_model",),
        options=dict(DRAFTING_OPTIONS),
    )
)
