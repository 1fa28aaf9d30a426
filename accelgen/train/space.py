"""Training SPACE's mask tokens and its mask-position LoRA (`accelgen train space`) for a frozen target: the shared
trainer of train/mask_tokens.py with no prompts and low-rank deltas on the attention projections, which act at the
mask positions only (heads/mask_tokens.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from accelgen.errors import InputError
from accelgen.heads.mask_tokens import MaskTokens
from accelgen.train.mask_tokens import new_mask_tokens


@dataclass
class SpaceConfig:
    count: int = field(default=3, metadata={"help": "Mask tokens: the draft's length.", "names": ("-k",)})
    rank: int = field(default=8, metadata={"help": "LoRA rank of the mask positions' adapter."})
    alpha: float = field(default=16.0, metadata={"help": "LoRA alpha (the delta is scaled by alpha / rank)."})
    lora_modules: str = field(default="q_proj,k_proj,v_proj,o_proj",
                              metadata={"help": "Comma-separated names of the linear layers adapted."})
    steps: int = 200
    batch_size: int = field(default=2, metadata={"help": "Windows per step."})
    cuts: int = field(default=16, metadata={"help": "Positions per window a group of masks hangs from."})
    learning_rate: float = 3e-3
    lora_learning_rate: float = field(default=1e-3, metadata={"help": "Learning rate of the mask-position LoRA."})
    checkpoint_every: int = 50

    def __post_init__(self):
        if min(self.count, self.rank, self.steps, self.batch_size, self.cuts, self.checkpoint_every) < 1 \
                or self.learning_rate <= 0 or self.lora_learning_rate <= 0 or self.alpha <= 0:
            raise InputError("masks, rank, alpha, steps, batch size, cuts, checkpoint interval and learning rates "
                             "must be positive")


def new_space_tokens(model, config: SpaceConfig, seed: int = 0) -> MaskTokens:
    names = tuple(name.strip() for name in config.lora_modules.split(",") if name.strip())
    return new_mask_tokens(model, "space", config.count, rank=config.rank, alpha=config.alpha, lora_names=names,
                           seed=seed)
