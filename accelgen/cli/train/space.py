"""`accelgen train space`: SPACE's mask tokens and the LoRA applied at their positions only, so that the frozen
target drafts inside its verifying forward (accelgen/train/mask_tokens.py)."""

from __future__ import annotations

from accelgen.cli.flags import Flags, command
from accelgen.cli.train.bita import MaskTokensRun, train_mask_tokens_run
from accelgen.train.loop import ScaleOut
from accelgen.train.space import SpaceConfig


def space(run: MaskTokensRun, config: SpaceConfig, scale: ScaleOut) -> None:
    """SPACE mask tokens + a mask-position LoRA: the frozen target drafts k tokens in its verifying forward."""
    from accelgen.train.space import new_space_tokens

    train_mask_tokens_run(run, config, "space", new_space_tokens, scale)


space_command = command(space, Flags(MaskTokensRun), Flags(SpaceConfig), Flags(ScaleOut))
