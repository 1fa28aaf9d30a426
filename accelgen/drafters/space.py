"""SPACE: smart parallel auto-correct decoding (Yi et al. 2024, arXiv:2402.11809).

Auto-correct decoding: one target forward verifies the previous candidates and, from k mask tokens appended after
each of them, proposes the next ones (drafters/mask_drafting.py). SPACE tunes the model itself semi-
autoregressively; to keep the base model's own outputs exact, only what the mask positions use trains here: the k
mask embeddings and a low-rank delta (LoRA) on the attention projections that is added at the appended positions
only, never at the target's own rows (heads/mask_tokens.py, `accelgen train space`). The output is greedy-exact.
"""

from __future__ import annotations

from accelgen.drafters.base import BuildContext
from accelgen.drafters.mask_drafting import (
    MaskDrafter,
    MaskDraftOptions,
    MaskOptions,
    make_drafter,
    runner_maker,
)
from accelgen.registry import MethodSpec, Part, register


def _make(build: BuildContext, options: MaskDraftOptions) -> MaskDrafter:
    return make_drafter(build, options)  # (the shared drafter, over the mask tokens its runner loaded)


register(
    MethodSpec(
        name="space",
        family="speculative",
        lossless="greedy-exact",
        paper="Yi et al. 2024, arXiv:2402.11809",
        summary="auto-correct decoding: one forward verifies the last candidates and proposes the next from mask "
                "tokens, through a LoRA applied at the mask positions only",
        drafter=Part(_make, MaskDraftOptions),
        runner=Part(runner_maker("space"), MaskOptions),
        needs=("heads",),
    )
)
