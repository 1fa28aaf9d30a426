"""Semi-autoregressive decoding (Wang, Zhang & Chen 2018, "Semi-Autoregressive Neural Machine Translation"):
K tokens per decoder pass instead of one.

The target is cut into groups of K consecutive tokens. Decoder position i reads the token K places before it
(the first K read BOS), and a group-causal mask lets every position of a group see all positions of its own and
earlier groups, none of later ones. So position i predicts target i from all tokens of the earlier groups and
none of its own: the K tokens of a group come out of one pass. K = 1 is the ordinary autoregressive decoder.
"""

from __future__ import annotations

import torch

from accelgen.errors import InputError
from accelgen.nar.ar import until_eos
from accelgen.nar.backbone import BackboneConfig, MethodModel, Seq2SeqBackbone, masked_cross_entropy
from accelgen.nar.tokens import BOS, EOS, NEVER_GENERATED, PAD, append_eos, shift_right


def group_causal_mask(length: int, group_size: int, device=None) -> torch.Tensor:
    """(length, length) bool, True where position i must not see position j: j's group (j // K) comes after i's."""
    groups = torch.arange(length, device=device) // group_size
    return groups.unsqueeze(0) > groups.unsqueeze(1)


class SATModel(MethodModel):
    method = "sat"

    def __init__(self, config: BackboneConfig, group_size: int = 2):
        super().__init__(config)
        if not 1 <= group_size <= config.max_target_len:
            raise InputError(f"group_size must be in 1..{config.max_target_len}, got {group_size}")
        self.group_size = group_size

    def options(self) -> dict:
        return {"group_size": self.group_size}

    def teacher_forced_logits(self, src_ids: torch.Tensor, src_mask: torch.Tensor, targets: torch.Tensor,
                              target_mask: torch.Tensor) -> torch.Tensor:
        """src (B, S), targets (B, T) ending in EOS -> logits (B, T, V), every position at once, position i
        predicting targets[:, i] from the targets of the groups before its own."""
        memory = self.backbone.encode(src_ids, src_mask)
        inputs = shift_right(targets, self.group_size)
        input_mask = torch.ones_like(target_mask)  # K BOS, then targets[:, :-K]: real wherever a target K later is
        input_mask[:, self.group_size:] = target_mask[:, :-self.group_size]
        mask = group_causal_mask(targets.shape[1], self.group_size, targets.device)
        return self.backbone.decode_tokens(inputs, input_mask, memory, src_mask, mask)

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        targets, target_mask = append_eos(batch["tgt"], batch["tgt_mask"])
        logits = self.teacher_forced_logits(batch["src"], batch["src_mask"], targets, target_mask)
        return masked_cross_entropy(logits, targets, target_mask), {}

    @torch.no_grad()
    def generate(self, src_ids: torch.Tensor, src_mask: torch.Tensor, max_length: int | None = None) -> list[list[int]]:
        return semi_autoregressive_decode(self.backbone, src_ids, src_mask, self.group_size, max_length)


@torch.no_grad()
def semi_autoregressive_decode(backbone: Seq2SeqBackbone, src_ids: torch.Tensor, src_mask: torch.Tensor,
                               group_size: int, max_length: int | None = None) -> list[list[int]]:
    """Greedy decoding of each source (B, S), group_size tokens per decoder pass: each pass appends the argmaxes
    of the next group's positions, until every row has produced EOS or max_length tokens (default and most:
    max_target_len, the longest target). Returns the target ids of each, without EOS."""
    max_length = min(max_length or backbone.config.max_target_len, backbone.config.max_target_len)
    memory = backbone.encode(src_ids, src_mask)
    rows = len(src_ids)
    tokens = torch.empty(rows, 0, dtype=torch.long, device=src_ids.device)
    finished = torch.zeros(rows, dtype=torch.bool, device=src_ids.device)
    while tokens.shape[1] < max_length and not finished.all():
        done = tokens.shape[1]
        length = min(done + group_size, max_length)  # the next group's positions, up to max_length
        inputs = torch.cat([torch.full((rows, group_size), BOS, device=src_ids.device), tokens], dim=1)[:, :length]
        logits = backbone.decode_tokens(inputs, torch.ones_like(inputs, dtype=torch.bool), memory, src_mask,
                                        group_causal_mask(length, group_size, src_ids.device))[:, done:]
        logits[..., list(NEVER_GENERATED)] = float("-inf")
        group = logits.argmax(-1)  # (rows, tokens of this group)
        for position in range(group.shape[1]):  # a row that has produced EOS only pads from then on
            group[:, position] = torch.where(finished, PAD, group[:, position])
            finished |= group[:, position] == EOS
        tokens = torch.cat([tokens, group], dim=1)
    return [until_eos(row) for row in tokens.tolist()]
