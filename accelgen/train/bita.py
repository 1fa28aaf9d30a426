"""Training BiTA's soft prompt and mask tokens (`accelgen train bita`) for a frozen target: the shared trainer of
train/mask_tokens.py with prompts and no adapter."""

from __future__ import annotations

from dataclasses import dataclass, field

from accelgen.errors import InputError
from accelgen.heads.mask_tokens import MaskTokens
from accelgen.train.mask_tokens import new_mask_tokens


@dataclass
class BitaConfig:
    count: int = field(default=3, metadata={"help": "Mask tokens: the draft's length.", "names": ("-k",)})
    prompts: int = field(default=2, metadata={"help": "Soft prompt embeddings fed before the masks."})
    steps: int = 200
    batch_size: int = field(default=2, metadata={"help": "Windows per step."})
    cuts: int = field(default=16, metadata={"help": "Positions per window a group of masks hangs from."})
    learning_rate: float = 3e-3
    checkpoint_every: int = 50

    def __post_init__(self):
        if min(self.count, self.steps, self.batch_size, self.cuts, self.checkpoint_every) < 1 or self.prompts < 0 \
                or self.learning_rate <= 0:
            raise InputError("masks, steps, batch size, cuts, checkpoint interval and learning rate must be positive, "
                             "and prompts not negative")


def new_bita_tokens(model, config: BitaConfig, seed: int = 0) -> MaskTokens:
    return new_mask_tokens(model, "bita", config.count, prompt_count=config.prompts, seed=seed)
