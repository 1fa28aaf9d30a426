"""Mask-Predict with a conditional masked language model (CMLM) (Ghazvininejad, Levy, Liu & Zettlemoyer 2019,
"Mask-Predict: Parallel Decoding of Conditional Masked Language Models").

Training: a random number n ~ Uniform{1..N} of the N target tokens is replaced by MASK, and the decoder (no
attention mask: every position sees every other) learns to predict the masked tokens from the source and the
unmasked ones; the length predictor learns N alongside.

Decoding, for each of the `length_candidates` most likely lengths N: start from N masks and predict them all;
then for iterations t = 1 .. T-1, re-mask the n = N·(T−t)/T tokens predicted with the lowest probability and
predict those again (the others keep their token and probability); an iteration that re-masks nothing (short
targets: N·(T−t) < T) costs no pass. The candidate with the highest average log-probability is the output.
"""

from __future__ import annotations

import torch

from accelgen.errors import InputError
from accelgen.nar.backbone import MethodModel, length_loss, masked_cross_entropy
from accelgen.nar.tokens import EOS, MASK, NEVER_GENERATED, length_mask


def lowest_confidence_positions(confidence: torch.Tensor, target_mask: torch.Tensor,
                                counts: torch.Tensor) -> torch.Tensor:
    """confidence (N, L), target_mask (N, L) bool, counts (N,) -> (N, L) bool: the counts[i] real positions of row
    i with the lowest confidence (ties: the earlier position first); padding is never chosen."""
    scores = confidence.masked_fill(~target_mask, float("inf"))
    order = scores.argsort(dim=1, stable=True)
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device)
                                             .expand_as(order).contiguous())
    return (ranks < counts.unsqueeze(1)) & target_mask


def remask_count(lengths: torch.Tensor, iteration: int, iterations: int) -> torch.Tensor:
    """How many tokens iteration t (1 .. T-1) re-masks: n = N·(T−t)/T, rounded down; lengths (N,) -> (N,)."""
    return lengths * (iterations - iteration) // iterations


class CMLMModel(MethodModel):
    method = "mask-predict"

    def training_inputs(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The batch with "masked" (B, T): n ~ Uniform{1..N} random positions of each target."""
        target_mask = batch["tgt_mask"]
        lengths = target_mask.sum(dim=1)
        counts = (torch.rand(len(lengths), generator=generator) * lengths).long() + 1  # 1..N
        random_order = torch.rand(target_mask.shape, generator=generator)
        return {**batch, "masked": lowest_confidence_positions(random_order, target_mask, counts)}

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """The cross-entropy of the masked tokens, plus the length predictor's."""
        src, src_mask, tgt, tgt_mask, masked = batch["src"], batch["src_mask"], batch["tgt"], batch["tgt_mask"], \
            batch["masked"]
        memory = self.backbone.encode(src, src_mask)
        logits = self.backbone.decode_tokens(torch.where(masked, MASK, tgt), tgt_mask, memory, src_mask)
        tokens = masked_cross_entropy(logits, tgt, masked)
        lengths = length_loss(self.backbone, memory, src_mask, tgt_mask)
        return tokens + lengths, {"token_loss": float(tokens.detach()), "length_loss": float(lengths.detach())}

    @torch.no_grad()
    def generate(self, src_ids: torch.Tensor, src_mask: torch.Tensor, iterations: int = 10,
                 length_candidates: int = 3) -> list[list[int]]:
        return mask_predict(self, src_ids, src_mask, iterations, length_candidates)


def predict_masked(model: CMLMModel, tokens: torch.Tensor, target_mask: torch.Tensor, memory: torch.Tensor,
                   src_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One parallel pass over tokens (N, L) (MASK where unknown): (most likely token, its log-probability) at
    every position, each (N, L); specials and EOS are never predicted (the length is decided)."""
    logits = model.backbone.decode_tokens(tokens, target_mask, memory, src_mask)
    logits[..., list(NEVER_GENERATED) + [EOS]] = float("-inf")
    log_probs, predicted = logits.log_softmax(-1).max(dim=-1)
    return predicted, log_probs


@torch.no_grad()
def mask_predict(model: CMLMModel, src_ids: torch.Tensor, src_mask: torch.Tensor, iterations: int = 10,
                 length_candidates: int = 3) -> list[list[int]]:
    """The target ids of each source (B, S): `iterations` rounds of Mask-Predict for each of its
    `length_candidates` most likely lengths, all candidates decoded together; the best average log-prob wins."""
    if iterations < 1 or length_candidates < 1:
        raise InputError(f"iterations and length_candidates must be >= 1, got {iterations} and {length_candidates}")
    backbone = model.backbone
    memory = backbone.encode(src_ids, src_mask)
    count = min(length_candidates, backbone.config.max_target_len)
    lengths = (backbone.length_logits(memory, src_mask).topk(count, dim=-1).indices + 1).flatten()  # (B * count,)
    memory, src_mask = memory.repeat_interleave(count, 0), src_mask.repeat_interleave(count, 0)
    width = int(lengths.max())
    target_mask = length_mask(lengths, width)  # (B * count, width)
    tokens = torch.full(target_mask.shape, MASK, dtype=torch.long, device=lengths.device)
    confidence = torch.zeros(target_mask.shape, device=lengths.device)  # log-probability of each token
    for iteration in range(iterations):
        if iteration == 0:
            remask = target_mask  # everything is unknown
        else:
            remask = lowest_confidence_positions(confidence, target_mask,
                                                 remask_count(lengths, iteration, iterations))
            if not remask.any():  # N·(T−t)/T < 1 for every candidate: the pass would change nothing
                continue
        predicted, log_probs = predict_masked(model, torch.where(remask, MASK, tokens), target_mask, memory, src_mask)
        tokens = torch.where(remask, predicted, tokens)
        confidence = torch.where(remask, log_probs, confidence)
    average = (confidence * target_mask).sum(dim=1) / lengths  # (B * count,)
    best = average.view(-1, count).argmax(dim=1)
    rows = torch.arange(len(best), device=best.device) * count + best
    return [tokens[row][target_mask[row]].tolist() for row in rows.tolist()]
