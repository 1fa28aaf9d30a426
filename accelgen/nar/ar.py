"""The autoregressive (AR) student: the baseline every NAR method is measured against, the same backbone and size
trained on the same data (Vaswani et al. 2017, "Attention Is All You Need"; the student of Gu et al. 2018's
comparison).

Training is teacher-forced: the decoder reads BOS + the target and, under a causal mask, learns to predict the
target + EOS, every position in one pass. Decoding is greedy, one token per pass, until EOS. The same network
scores whole sequences (`sequence_log_probs`), which is what noisy parallel decoding asks of a teacher.
"""

from __future__ import annotations

import torch

from accelgen.nar.backbone import MethodModel, causal_mask, masked_cross_entropy
from accelgen.nar.tokens import BOS, EOS, NEVER_GENERATED, PAD, append_eos, shift_right


class ARStudent(MethodModel):
    method = "ar"

    def teacher_forced_logits(self, src_ids: torch.Tensor, src_mask: torch.Tensor, targets: torch.Tensor,
                              target_mask: torch.Tensor) -> torch.Tensor:
        """src (B, S), targets (B, T) ending in EOS -> logits (B, T, V), position i predicting targets[:, i]
        from targets[:, :i]."""
        memory = self.backbone.encode(src_ids, src_mask)
        inputs = shift_right(targets)
        length = targets.shape[1]
        input_mask = torch.ones_like(target_mask)  # BOS + targets[:, :-1]: real wherever a later target is
        input_mask[:, 1:] = target_mask[:, :-1]
        return self.backbone.decode_tokens(inputs, input_mask, memory, src_mask, causal_mask(length, src_ids.device))

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        targets, target_mask = append_eos(batch["tgt"], batch["tgt_mask"])
        logits = self.teacher_forced_logits(batch["src"], batch["src_mask"], targets, target_mask)
        return masked_cross_entropy(logits, targets, target_mask), {}

    @torch.no_grad()
    def sequence_log_probs(self, src_ids: torch.Tensor, src_mask: torch.Tensor, tgt_ids: torch.Tensor,
                           tgt_mask: torch.Tensor) -> torch.Tensor:
        """log p(target + EOS | source) for each row: src (N, S), tgt (N, T) (no EOS) -> (N,). A scorer of
        candidate sequences for noisy parallel decoding, all rows in one batched pass."""
        targets, target_mask = append_eos(tgt_ids, tgt_mask)
        logits = self.teacher_forced_logits(src_ids, src_mask, targets, target_mask)
        token_log_probs = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return (token_log_probs * target_mask).sum(dim=1)

    @torch.no_grad()
    def generate(self, src_ids: torch.Tensor, src_mask: torch.Tensor, max_length: int | None = None) -> list[list[int]]:
        """Greedy decoding of each source (B, S): the target ids of each, without EOS."""
        return greedy_decode(self, src_ids, src_mask, max_length)


def greedy_decode(model: MethodModel, src_ids: torch.Tensor, src_mask: torch.Tensor,
                  max_length: int | None = None) -> list[list[int]]:
    """One token per decoder pass, each the argmax given the source and the tokens before it, until every row has
    produced EOS or max_length tokens (default and most: max_target_len, the longest target)."""
    backbone = model.backbone
    max_length = min(max_length or backbone.config.max_target_len, backbone.config.max_target_len)
    memory = backbone.encode(src_ids, src_mask)
    rows = len(src_ids)
    tokens = torch.empty(rows, 0, dtype=torch.long, device=src_ids.device)
    finished = torch.zeros(rows, dtype=torch.bool, device=src_ids.device)
    while tokens.shape[1] < max_length and not finished.all():
        inputs = torch.cat([torch.full((rows, 1), BOS, device=src_ids.device), tokens], dim=1)
        length = inputs.shape[1]
        logits = backbone.decode_tokens(inputs, torch.ones_like(inputs, dtype=torch.bool), memory, src_mask,
                                        causal_mask(length, src_ids.device))[:, -1]
        logits[:, list(NEVER_GENERATED)] = float("-inf")
        chosen = torch.where(finished, PAD, logits.argmax(-1))  # a finished row only pads
        tokens = torch.cat([tokens, chosen.unsqueeze(1)], dim=1)
        finished |= chosen == EOS
    return [until_eos(row) for row in tokens.tolist()]


def until_eos(ids: list[int]) -> list[int]:
    """ids up to (without) the first EOS, without padding."""
    kept = ids[:ids.index(EOS)] if EOS in ids else ids
    return [index for index in kept if index != PAD]
