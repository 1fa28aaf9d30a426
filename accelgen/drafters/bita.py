"""BiTA: bi-directional tuning for lossless acceleration (Lin et al. 2024, arXiv:2401.12522).

The frozen target drafts the next k tokens semi-autoregressively in the same forward that verifies the previous
draft (drafters/mask_drafting.py): after the root and after every draft node it reads a learnable soft prompt
followed by k mask tokens, whose rows give the next draft. Only the prompt and mask embeddings train (`accelgen
train bita`, train/mask_tokens.py); the model is untouched, and verification keeps the output greedy-exact.

BiTA's prompts are deep (a prefix of keys and values at every layer); here they are input embeddings fed before
the masks of each group, which every mask sees and nothing real does (docs/bita-and-space.md).
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
        name="bita",
        family="speculative",
        lossless="greedy-exact",
        paper="Lin et al. 2024, arXiv:2401.12522",
        summary="the frozen target drafts k tokens with trained prompt and mask embeddings appended to the very "
                "forward that verifies the previous draft",
        drafter=Part(_make, MaskDraftOptions),
        runner=Part(runner_maker("bita"), MaskOptions),
        needs=("heads",),
    )
)
