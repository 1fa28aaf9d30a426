"""DistillSpec (Zhou et al. 2023, arXiv:2310.08461): speculative decoding with a draft model distilled
toward this target by `accelgen train distillspec` (train/distill.py).

Drafting and verification are `speculative`'s own (DraftModelDrafter, speculative sampling or greedy match),
so the output is the target's exactly; distillation only makes more drafts pass. The method refuses a draft
that was not distilled for this target: `distillspec.json` beside the draft's weights names the target, and
its fingerprint (a hash of the target's first embedding rows) must match the target being decoded.
"""

from __future__ import annotations

import hashlib
import json

import torch

from accelgen.drafters.base import BuildContext
from accelgen.drafters.draft_model import DraftingOptions, check_vocabularies, scheduled_draft_model_drafter
from accelgen.errors import InputError
from accelgen.models.loading import beside_weights
from accelgen.registry import MethodSpec, Part, register

DISTILLSPEC_FILE = "distillspec.json"  # beside a distilled draft's weights: what it was distilled for
FINGERPRINT_ROWS = 64  # embedding rows hashed to recognise a model
HOW_TO_DISTILL = "accelgen train distillspec --model TARGET --draft DRAFT --out FOLDER"


def model_fingerprint(model) -> str:
    """A short hash of the model's first embedding rows, rounded to bfloat16 so that the same weights loaded in
    float32 or bfloat16 give the same fingerprint."""
    rows = model.get_input_embeddings().weight[:FINGERPRINT_ROWS].detach().to(torch.bfloat16).cpu()
    return hashlib.sha1(rows.view(torch.int16).numpy().tobytes()).hexdigest()[:16]


def check_distilled(target_model, draft_model) -> dict:
    """The draft's distillspec.json, after checking that it was distilled for this target; else a ValueError."""
    path = beside_weights(draft_model, DISTILLSPEC_FILE)
    if path is None or not path.is_file():
        raise InputError(f"distillspec needs a draft distilled for this target, with {DISTILLSPEC_FILE} beside its "
                         f"weights; this draft has none. Distill one with `{HOW_TO_DISTILL}` and pass --draft FOLDER "
                         "(or use --method speculative for an undistilled draft)")
    info = json.loads(path.read_text())
    if info.get("target_fingerprint") != model_fingerprint(target_model):
        raise InputError(f"this draft was distilled for {info.get('target')!r}, not for this target; distill one for "
                         f"it with `{HOW_TO_DISTILL}`")
    return info


def _make(build: BuildContext, options: DraftingOptions):
    check_vocabularies(build.target_model, build.draft_model)  # a clearer refusal than a fingerprint mismatch
    check_distilled(build.target_model, build.draft_model)
    return scheduled_draft_model_drafter(build, **options.as_dict())


register(
    MethodSpec(
        name="distillspec",
        family="speculative",
        lossless="distribution-exact",
        paper="Zhou et al. 2023, arXiv:2310.08461",
        summary="speculative decoding with a draft distilled on its own generations toward this target "
                "(`accelgen train distillspec`)",
        drafter=Part(_make, DraftingOptions),
        needs=("draft_model",),
        draft_budget="measured",  # drafts capped by the measured costs unless the request fixes their length
    )
)
