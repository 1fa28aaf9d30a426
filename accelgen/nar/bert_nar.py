"""Non-autoregressive generation with a bidirectional masked-slot decoder, its length decided by EOS within a budget
set by the source length (Su, Cai, Wang, Vandyke, Baker, Li & Collier 2021, "Non-Autoregressive Text Generation with
Pre-trained Language Models", EACL; their code: github.com/yxuansu/NAG-BERT).

The paper's model (NAG-BERT): BERT reads the source, and output position i is predicted from BERT's hidden state at
source position i, every position at once; a CRF over the output positions models the dependency of neighbouring
tokens. Three ideas come with it:
- dynamic length: the model writes EOS where the output ends (in training the target is followed by two EOS, the
  second for the CRF's EOS-to-EOS transition; positions after them are padding, left out of the loss), and the
  output is everything before the first EOS. No length predictor: the model decides the length itself, at most
  the source length;
- ratio-first decoding: where the output's length is roughly a fixed share of the input's (summaries, sentence
  compression), only about the first α·S positions of a source of S tokens are decoded (their code: int(α·S) + 2),
  α set per task, which saves the decoding of the positions after them;
- a context-aware learning objective against the repeated tokens that conditionally independent positions write:
  besides the likelihood of its own target token y_i, position i is trained by unlikelihood to give little
  probability to the target tokens y_j of its neighbours, |i - j| <= c (the window size). The authors confirm
  this form (github.com/yxuansu/NAG-BERT/issues/4); their released code trains the CRF and likelihood losses only.

This implementation, on the shared backbone (backbone.py):
- the decoder reads T = ceil(α·S) MASK slots (at most max_target_len + 1: every target and its EOS fit) and attends
  to the encoded source, with no self-attention mask: one decoder pass writes every slot. It is trained to write
  the target, then EOS in every slot after it; generation takes each slot's most likely token and cuts the output
  at the first EOS (`until_eos`), or at the last slot;
- α ("length_ratio", an option) is fitted from the training rows before training (`fit_length_ratio`): the ratio
  whose slots hold the target and its EOS for a given share (`coverage`) of them with the fewest slots
  (`covering_ratio`). A training row whose target does not fit gets as many slots as it needs, so no target is
  ever cut in training;
- the context-aware objective, with window size `context_window` (0: likelihood only), as `context_unlikelihood`.

Where it departs from the paper, and why:
- no pre-trained BERT (no downloads here): a small encoder-decoder trained from scratch, every method on the same
  one so that comparisons measure the decoding algorithm. Its backbone can start from another trained accelgen
  model's (`init_backbone_from`), the counterpart of starting from BERT. The output slots are the decoder's own
  positions, fed MASK, not the source's positions: the decoder is bidirectional like BERT, but it has up to
  max_target_len + 1 positions while sources are longer; so T is capped there rather than at the source length;
- no CRF: it is the separate nat-crf method; here the slots are decoded independently (argmax each), so the
  paper's second EOS, there for the CRF's transition, is not needed, and every slot after the target is trained to
  be EOS instead of padding (more supervision of where the output ends; the output is cut at the first EOS either
  way);
- α is fitted from the training rows' lengths (a coverage quantile) instead of set by hand per task, so that it
  needs no decoding runs;
- the released code has no unlikelihood term, so its details here are this implementation's reading: a neighbour
  that is the position's own target token is skipped (penalising it would contradict the likelihood term), the two
  terms are summed with weight 1 and averaged over the slots, and the default window is 2.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch

from accelgen.atomic import load_tensors
from accelgen.errors import InputError
from accelgen.nar.ar import until_eos
from accelgen.nar.backbone import (WEIGHTS_FILE, BackboneConfig, MethodModel, masked_cross_entropy,
                                   read_saved_config)
from accelgen.nar.tokens import EOS, MASK, NEVER_GENERATED, PAD, length_mask

# a ratio fitted as (L + 1) / S times S must give L + 1 slots, not L + 2 from the rounding of the product
ROUNDING_SLACK = 1e-9


# --- ratio-first lengths and slot targets (pure functions) --------------------------------------------------------


def slot_counts(source_lengths: torch.Tensor, length_ratio: float, max_slots: int) -> torch.Tensor:
    """source_lengths (B,) -> (B,): ceil(length_ratio · S) slots for a source of S tokens, clipped to 1..max_slots."""
    products = source_lengths.double() * length_ratio  # float64: the product of a fitted ratio is exact enough
    return torch.ceil(products - ROUNDING_SLACK).clamp(1, max_slots).long()


def covering_ratio(source_lengths: torch.Tensor, target_lengths: torch.Tensor, coverage: float = 1.0) -> float:
    """The ratio α whose ceil(α·S) slots hold the target and its EOS (L + 1 tokens) for at least `coverage` of the
    rows, with the fewest slots for every source length of the rows. source_lengths, target_lengths (N,).

    A row is covered when α·S > L, so every α above m, the ceil(coverage · N)-th smallest L / S, covers that share,
    and the fewest slots it gives a source of s tokens are floor(m·s) + 1 (the counts of any α just above m). The
    ratio returned is the largest that still gives each source length of the rows exactly those slots: min over s of
    (floor(m·s) + 1) / s, the farthest from m (and from rounding) among the equally short choices."""
    if not 0 < coverage <= 1:
        raise InputError(f"coverage must be in (0, 1], got {coverage}")
    if len(source_lengths) == 0 or len(source_lengths) != len(target_lengths):
        raise InputError(f"a length ratio is fitted on rows with a source and a target each, got "
                         f"{len(source_lengths)} source and {len(target_lengths)} target lengths")
    if int(source_lengths.min()) < 1:
        raise InputError("every source must have at least one token to fit a length ratio on")
    shares = (target_lengths.double() / source_lengths.double()).sort().values  # L / S, float64
    covered = max(math.ceil(coverage * len(shares) - ROUNDING_SLACK), 1)  # rows the ratio must hold
    bound = shares[covered - 1]  # m: the ratio must exceed it
    lengths = source_lengths.unique().double()
    # m·s is L·s/S: an integer, or at least 1/S away from one, so the slack only absorbs rounding
    fewest = torch.floor(bound * lengths + ROUNDING_SLACK) + 1
    return float((fewest / lengths).min())


def slot_targets(tgt_ids: torch.Tensor, tgt_mask: torch.Tensor,
                 slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tgt_ids (B, L), tgt_mask (B, L) bool, slots (B,) -> (targets (B, T), slot_mask (B, T) bool), T = the most
    slots: each row's target, then EOS in its remaining slots, PAD after them. A row needs L + 1 slots or more."""
    lengths = tgt_mask.sum(dim=1)
    if bool((slots < lengths + 1).any()):
        raise InputError("every row needs a slot for each target token and one for its EOS")
    width = int(slots.max())
    positions = torch.arange(width, device=tgt_ids.device).unsqueeze(0)  # (1, T)
    slot_mask = positions < slots.unsqueeze(1)
    targets = torch.full(slot_mask.shape, EOS, dtype=torch.long, device=tgt_ids.device)
    kept = min(tgt_ids.shape[1], width)
    real = tgt_mask[:, :kept]
    targets[:, :kept] = torch.where(real, tgt_ids[:, :kept], targets[:, :kept])
    return targets.masked_fill(~slot_mask, PAD), slot_mask


def context_unlikelihood(log_probs: torch.Tensor, targets: torch.Tensor, slot_mask: torch.Tensor,
                         window: int) -> torch.Tensor:
    """The context-aware objective's unlikelihood term: the sum over slots i and neighbours j, 0 < |i - j| <= window
    (both real slots, targets[j] != targets[i]), of -log(1 - p_i(targets[j])), divided by the number of real slots.
    log_probs (B, T, V), targets (B, T), slot_mask (B, T) bool -> a scalar."""
    total = log_probs.new_zeros(())
    width = targets.shape[1]
    for offset in [step for distance in range(1, window + 1) for step in (-distance, distance)]:
        if abs(offset) >= width:
            continue
        # slot i's neighbour i + offset, for the slots i that have one
        here = slice(max(-offset, 0), width - max(offset, 0))
        there = slice(max(offset, 0), width - max(-offset, 0))
        neighbours = targets[:, there]
        counted = slot_mask[:, here] & slot_mask[:, there] & (neighbours != targets[:, here])
        neighbour_probs = log_probs[:, here].gather(-1, neighbours.unsqueeze(-1)).squeeze(-1).exp()
        # clamped below 1: a position sure of its neighbour's token gives a large but finite loss
        unlikelihood = -torch.log1p(-neighbour_probs.clamp(max=1 - 1e-6))
        total = total + (unlikelihood * counted).sum()
    return total / slot_mask.sum().clamp(min=1)


# --- the model -------------------------------------------------------------------------------------------------


class BertNARModel(MethodModel):
    method = "bert-nar"

    def __init__(self, config: BackboneConfig, length_ratio: float | None = None, context_window: int = 2):
        super().__init__(config)
        if length_ratio is not None and (isinstance(length_ratio, bool) or not isinstance(length_ratio, (int, float))
                                         or not (math.isfinite(length_ratio) and length_ratio > 0)):
            raise InputError(f"length_ratio must be a positive number (or None until fit_length_ratio), got "
                             f"{length_ratio!r}")
        if isinstance(context_window, bool) or not isinstance(context_window, int) or context_window < 0:
            raise InputError(f"context_window must be an integer >= 0 (0: no unlikelihood term), got "
                             f"{context_window!r}")
        self.length_ratio = None if length_ratio is None else float(length_ratio)
        self.context_window = context_window

    def options(self) -> dict:
        return {"length_ratio": self.length_ratio, "context_window": self.context_window}

    def fit_to_data(self, rows: dict[str, torch.Tensor], vocabulary) -> None:
        if self.length_ratio is None:  # a ratio given as an option is kept
            self.fit_length_ratio(rows)

    def fit_length_ratio(self, rows: dict[str, torch.Tensor], coverage: float = 1.0) -> float:
        """Sets (and returns) length_ratio from training rows ({"src_mask" (N, S), "tgt_mask" (N, L)}): the ratio
        whose slots hold the target and its EOS for `coverage` of them with the fewest slots (covering_ratio). Call
        it before training."""
        self.length_ratio = covering_ratio(rows["src_mask"].sum(dim=1), rows["tgt_mask"].sum(dim=1), coverage)
        return self.length_ratio

    def init_backbone_from(self, folder: Path) -> BertNARModel:
        """Copies the backbone weights of another trained accelgen NAR model (any method, or the AR student) saved in
        folder, whose backbone must have this one's sizes (dropout may differ): the counterpart of the paper's
        starting from BERT. Not an option: a saved model must load without the folder it started from."""
        saved = read_saved_config(folder)
        config = BackboneConfig(**saved["backbone"])
        if replace(config, dropout=self.config.dropout) != self.config:
            raise InputError(f"the backbone in {folder} ({config}) does not have this model's sizes ({self.config})")
        state = load_tensors(Path(folder) / WEIGHTS_FILE, "save the model again")
        backbone = {name.removeprefix("backbone."): tensor for name, tensor in state.items()
                    if name.startswith("backbone.")}
        try:
            self.backbone.load_state_dict(backbone)
        except RuntimeError as error:
            raise InputError(f"the weights in {folder} do not fit its config.json: {str(error)[:200]}") from None
        return self

    def slots(self, src_mask: torch.Tensor) -> torch.Tensor:
        """src_mask (B, S) -> the ratio-first slot count of each source (B,)."""
        if self.length_ratio is None:
            raise InputError("length_ratio is not set: fit it on the training rows with fit_length_ratio(rows) "
                             "before training, or pass length_ratio=")
        return slot_counts(src_mask.sum(dim=1), self.length_ratio, self.config.max_target_len + 1)

    def slot_logits(self, memory: torch.Tensor, src_mask: torch.Tensor, slot_mask: torch.Tensor) -> torch.Tensor:
        """One decoder pass over MASK slots: memory (B, S, width), src_mask (B, S), slot_mask (B, T) bool -> logits
        (B, T, V). No attention mask: every slot sees every other real slot."""
        inputs = torch.full(slot_mask.shape, MASK, dtype=torch.long, device=slot_mask.device)
        return self.backbone.decode_tokens(inputs, slot_mask, memory, src_mask)

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """The slots' cross-entropy (the target, then EOS) plus the context-aware unlikelihood term."""
        src, src_mask, tgt, tgt_mask = batch["src"], batch["src_mask"], batch["tgt"], batch["tgt_mask"]
        slots = torch.maximum(self.slots(src_mask), tgt_mask.sum(dim=1) + 1)  # a long target is never cut
        targets, slot_mask = slot_targets(tgt, tgt_mask, slots)
        logits = self.slot_logits(self.backbone.encode(src, src_mask), src_mask, slot_mask)
        tokens = masked_cross_entropy(logits, targets, slot_mask)
        if self.context_window == 0:
            return tokens, {"token_loss": float(tokens.detach())}
        context = context_unlikelihood(logits.log_softmax(-1), targets, slot_mask, self.context_window)
        return tokens + context, {"token_loss": float(tokens.detach()), "context_loss": float(context.detach())}

    @torch.no_grad()
    def generate(self, src_ids: torch.Tensor, src_mask: torch.Tensor) -> list[list[int]]:
        """The target ids of each source (B, S): its ratio-first slots decoded in one pass, each slot's most likely
        token, cut at the first EOS."""
        return ratio_first_decode(self, src_ids, src_mask)


@torch.no_grad()
def ratio_first_decode(model: BertNARModel, src_ids: torch.Tensor, src_mask: torch.Tensor) -> list[list[int]]:
    """src_ids (B, S), src_mask (B, S) -> each source's output: ceil(α·S) MASK slots, one decoder pass, each slot's
    argmax (never a special but EOS), everything before the first EOS (all slots when there is none)."""
    slots = model.slots(src_mask)
    slot_mask = length_mask(slots)
    logits = model.slot_logits(model.backbone.encode(src_ids, src_mask), src_mask, slot_mask)
    logits[..., list(NEVER_GENERATED)] = float("-inf")
    tokens = logits.argmax(-1).masked_fill(~slot_mask, EOS)  # a shorter row ends at its last slot
    return [until_eos(row) for row in tokens.tolist()]
