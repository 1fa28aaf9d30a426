"""Iterative refinement (Lee, Mansimov & Cho 2018, "Deterministic Non-Autoregressive Neural Sequence Modeling by
Iterative Refinement", EMNLP): a parallel first draft, then parallel passes that rewrite the previous output.

The paper's model: a first decoder reads the source's embeddings copied uniformly to the target length (Gu et
al.'s uniform copy; the length comes from a length predictor on the encoder) and writes Y^0, every position at
once; a second decoder, shared by all later passes, reads the previous output Y^(l-1) and writes Y^l, of the same
length, again every position at once. The model is seen two ways, and trained both ways at once:

- a latent variable model p(Y|X) = sum over Y^0..Y^L of p(Y|Y^L, X) ... p(Y^1|Y^0, X) p(Y^0|X), trained on a
  deterministic lower bound: every pass is taught the reference Y* while it reads the argmax of the pass before
  (the model's own previous output, not differentiated through);
- a conditional denoising autoencoder: a refinement pass that reads a corrupted reference C(Y*) is taught Y*
  (the corruptions: tokens replaced by random ones, tokens repeated, neighbours swapped).

In training each refinement pass reads, per row, the corrupted reference with probability `denoising` (the
paper's alpha) and the model's previous output otherwise; the loss sums every pass's cross-entropy. Decoding runs
the first pass, then refines each row until its output stops changing (a fixed point: the pass wrote exactly what
it read) or for at most `max_iterations` passes (the paper's adaptive number of refinement steps).

Where this implementation differs, and why:

- one decoder, not two: the backbone every method shares has one, so refinement passes share it with the first
  pass and are told apart by a learnt vector (`refinement_marker`) added to every decoder input of a refinement
  pass (the first pass reads copied source embeddings, which carry no marker);
- a refinement pass reads the embeddings of the previous output's tokens only; the paper's code also adds the
  previous pass's final hidden states. Tokens alone make an unchanged output a true fixed point (the same tokens in
  give the same tokens out, so a further pass cannot change them) and let the same pass read corrupted references,
  which have no hidden states;
- the stopping test is exact equality of consecutive outputs; the paper's released code also offers a Jaccard
  distance between them;
- the corruption follows fairseq's reimplementation of the paper (each real token is corrupted with probability
  `corruption_rate`, beta = 0.33 there, split equally among replace, repeat and swap, applied left to right; the
  choice to denoise made per row, alpha = 0.5) rather than the paper's code, which corrupts a fixed share of
  positions (a share that can shrink from pass to pass), also drops tokens, and decides per batch. A corruption
  here never changes a target's length, as no refinement pass does;
- the length predictor is the backbone's (a classification over 1..max_target_len from the pooled encoder),
  trained jointly with the passes, where the paper's code fine-tunes it afterwards; no post-processing removes
  repeated tokens (the paper's code can).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from accelgen.errors import InputError
from accelgen.nar.backbone import BackboneConfig, MethodModel, length_loss, masked_cross_entropy
from accelgen.nar.nat import copy_positions, uniform_fertilities
from accelgen.nar.tokens import SPECIALS, fixed_length_tokens

# the corruption applied at a target position (codes of `draw_corruptions`)
KEEP, REPLACE, REPEAT, SWAP = range(4)


# --- the denoising objective's corruption (pure functions) ------------------------------------------------------


def draw_corruptions(target_mask: torch.Tensor, rate: float, vocab_size: int,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """target_mask (B, T) bool -> (operations (B, T) of KEEP/REPLACE/REPEAT/SWAP, random_tokens (B, T)): each real
    position is corrupted with probability rate, the three corruptions equally likely; random_tokens are what a
    REPLACE writes (any token but the specials). All draws come from generator; padding is always KEEP."""
    choices = torch.rand(target_mask.shape, generator=generator)
    random_tokens = torch.randint(len(SPECIALS), vocab_size, target_mask.shape, generator=generator)
    operations = torch.full(target_mask.shape, KEEP, dtype=torch.long)
    corrupted = (choices < rate) & target_mask.cpu()
    kind = (choices / max(rate, 1e-12) * 3).long().clamp(max=2)  # 0, 1, 2: which third of [0, rate) it fell in
    operations[corrupted] = (REPLACE + kind)[corrupted]
    return operations.to(target_mask.device), random_tokens.to(target_mask.device)


def apply_corruptions(targets: torch.Tensor, target_mask: torch.Tensor, operations: torch.Tensor,
                      random_tokens: torch.Tensor) -> torch.Tensor:
    """targets (B, T), target_mask (B, T) bool, operations (B, T), random_tokens (B, T) -> corrupted (B, T).
    Positions left to right, each operation acting on the sequence as the earlier ones left it: REPLACE writes
    random_tokens at t; REPEAT copies the token at t over t + 1; SWAP exchanges t and t + 1. An operation on
    padding, or a REPEAT or SWAP whose t + 1 is padding, does nothing: padding and the length never change."""
    corrupted = targets.clone()
    for position in range(targets.shape[1]):
        here, operation = corrupted[:, position].clone(), operations[:, position]
        replace = (operation == REPLACE) & target_mask[:, position]
        corrupted[:, position] = torch.where(replace, random_tokens[:, position], here)
        if position + 1 == targets.shape[1]:
            break
        after = corrupted[:, position + 1].clone()
        has_next = target_mask[:, position + 1]
        swap, repeat = (operation == SWAP) & has_next, (operation == REPEAT) & has_next
        corrupted[:, position] = torch.where(swap, after, corrupted[:, position])
        corrupted[:, position + 1] = torch.where(swap | repeat, here, after)
    return corrupted


def corrupt_targets(targets: torch.Tensor, target_mask: torch.Tensor, rate: float, vocab_size: int,
                    generator: torch.Generator) -> torch.Tensor:
    """C(Y*): targets (B, T) with each real token corrupted (replaced, repeated or swapped) with probability rate."""
    operations, random_tokens = draw_corruptions(target_mask, rate, vocab_size, generator)
    return apply_corruptions(targets, target_mask, operations, random_tokens)


# --- the passes (pure functions of a model) ---------------------------------------------------------------------


def initial_logits(model: RefineModel, src_ids: torch.Tensor, src_mask: torch.Tensor, memory: torch.Tensor,
                   lengths: torch.Tensor, target_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first pass: src_ids (B, S), src_mask (B, S), memory (B, S, width), lengths (B,) -> (logits (B, T, V),
    target_mask (B, T)), T = target_width, the decoder reading the source's embeddings copied uniformly to each
    length."""
    fertility = uniform_fertilities(src_mask.sum(dim=1), lengths, src_ids.shape[1])
    positions, target_mask = copy_positions(fertility, target_width)
    source_embeddings = model.backbone.embed_tokens(src_ids)  # (B, S, width)
    inputs = source_embeddings.gather(1, positions.unsqueeze(-1).expand(-1, -1, source_embeddings.shape[-1]))
    hidden = model.backbone.decode(inputs, target_mask, memory, src_mask)  # no attention mask: all at once
    return model.backbone.logits(hidden), target_mask


def refinement_logits(model: RefineModel, tokens: torch.Tensor, target_mask: torch.Tensor, memory: torch.Tensor,
                      src_mask: torch.Tensor) -> torch.Tensor:
    """A refinement pass: tokens (B, T) (a previous output or a corrupted reference), target_mask (B, T),
    memory (B, S, width), src_mask (B, S) -> logits (B, T, V) of a new output of the same length."""
    inputs = model.backbone.embed_tokens(tokens) + model.refinement_marker  # the marker: "this is a refinement pass"
    return model.backbone.logits(model.backbone.decode(inputs, target_mask, memory, src_mask))


def initial_pass(model: RefineModel, src_ids: torch.Tensor, src_mask: torch.Tensor, memory: torch.Tensor,
                 lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Y^0: (tokens (B, T), target_mask (B, T)) at lengths (B,) (T: the longest), PAD past each length."""
    logits, target_mask = initial_logits(model, src_ids, src_mask, memory, lengths, int(lengths.max()))
    return fixed_length_tokens(logits, target_mask), target_mask


def refinement_pass(model: RefineModel, tokens: torch.Tensor, target_mask: torch.Tensor, memory: torch.Tensor,
                    src_mask: torch.Tensor) -> torch.Tensor:
    """Y^l from Y^(l-1): tokens (B, T) -> tokens (B, T), each position's most likely token, PAD on padding."""
    return fixed_length_tokens(refinement_logits(model, tokens, target_mask, memory, src_mask), target_mask)


# --- the model ---------------------------------------------------------------------------------------------------


class RefineModel(MethodModel):
    method = "refine"

    def __init__(self, config: BackboneConfig, training_passes: int = 3, denoising: float = 0.5,
                 corruption_rate: float = 0.33):
        """training_passes: refinement passes after the first one in each training step (>= 1); denoising: the
        probability that a refinement pass reads, for a row, the corrupted reference instead of the model's
        previous output (0: the lower bound alone, 1: the denoising autoencoder alone); corruption_rate: the
        probability that a reference token is corrupted. The defaults are fairseq's (4 passes in all, alpha 0.5,
        beta 0.33)."""
        super().__init__(config)
        if training_passes < 1:
            raise InputError(f"training_passes must be >= 1 (refinement passes per training step), got "
                             f"{training_passes}")
        for name, value in (("denoising", denoising), ("corruption_rate", corruption_rate)):
            if not 0.0 <= value <= 1.0:
                raise InputError(f"{name} is a probability, in [0, 1], got {value}")
        if config.vocab_size <= len(SPECIALS):
            raise InputError(f"a vocabulary of {config.vocab_size} ids has no token beyond the {len(SPECIALS)} "
                             f"specials to write")
        self.training_passes, self.denoising, self.corruption_rate = training_passes, denoising, corruption_rate
        self.refinement_marker = nn.Parameter(torch.randn(config.width))  # like a position embedding's N(0, 1)

    def options(self) -> dict:
        return {"training_passes": self.training_passes, "denoising": self.denoising,
                "corruption_rate": self.corruption_rate}

    def training_inputs(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The batch with, for each refinement pass of training, "corrupted" (B, passes, T): a corruption of each
        target, and "denoised" (B, passes) bool: whether the pass reads it (else the previous output); unless the
        batch brings its own."""
        if "corrupted" in batch:
            return batch
        targets, target_mask = batch["tgt"], batch["tgt_mask"]
        denoised = torch.rand(len(targets), self.training_passes, generator=generator) < self.denoising
        corrupted = torch.stack([corrupt_targets(targets, target_mask, self.corruption_rate, self.config.vocab_size,
                                                 generator) for _ in range(self.training_passes)], dim=1)
        return {**batch, "corrupted": corrupted, "denoised": denoised.to(targets.device)}

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """The length predictor's cross-entropy, plus the first pass's (at the true length), plus every
        refinement pass's, each reading its row's corrupted target or the previous pass's argmax."""
        src, src_mask, tgt, tgt_mask = batch["src"], batch["src_mask"], batch["tgt"], batch["tgt_mask"]
        corrupted, denoised = batch["corrupted"], batch["denoised"]
        if corrupted.shape != (len(tgt), self.training_passes, tgt.shape[1]) or \
                denoised.shape != (len(tgt), self.training_passes):
            raise InputError(f"a batch needs 'corrupted' (rows, {self.training_passes}, target width) and "
                             f"'denoised' (rows, {self.training_passes}) for this model's training_passes, got "
                             f"{tuple(corrupted.shape)} and {tuple(denoised.shape)}")
        memory = self.backbone.encode(src, src_mask)
        lengths = length_loss(self.backbone, memory, src_mask, tgt_mask)
        logits, _ = initial_logits(self, src, src_mask, memory, tgt_mask.sum(dim=1), tgt.shape[1])
        initial = masked_cross_entropy(logits, tgt, tgt_mask)
        previous = fixed_length_tokens(logits, tgt_mask)  # detached: the bound is not differentiated through Y^(l-1)
        refinements = []
        for step in range(self.training_passes):
            inputs = torch.where(denoised[:, step:step + 1], corrupted[:, step], previous)
            logits = refinement_logits(self, inputs, tgt_mask, memory, src_mask)
            refinements.append(masked_cross_entropy(logits, tgt, tgt_mask))
            previous = fixed_length_tokens(logits, tgt_mask)
        refinement = torch.stack(refinements)
        total = lengths + initial + refinement.sum()
        return total, {"initial_loss": float(initial.detach()), "refinement_loss": float(refinement.detach().mean()),
                       "last_pass_loss": float(refinement[-1].detach()), "length_loss": float(lengths.detach())}

    @torch.no_grad()
    def generate(self, src_ids: torch.Tensor, src_mask: torch.Tensor, max_iterations: int = 10) -> list[list[int]]:
        """The target ids of each source (B, S): the first pass, refined to a fixed point or max_iterations times."""
        return refine_decode(self, src_ids, src_mask, max_iterations).sequences


# --- decoding ------------------------------------------------------------------------------------------------------


@dataclass
class Refinement:
    sequences: list[list[int]]  # per source: its last output
    passes: list[int]  # per source: the refinement passes it ran (the first pass not counted)
    converged: list[bool]  # per source: whether its last pass returned its input unchanged (a fixed point)


@torch.no_grad()
def refine_decode(model: RefineModel, src_ids: torch.Tensor, src_mask: torch.Tensor,
                  max_iterations: int = 10) -> Refinement:
    """Each source (B, S): the first pass at its most likely length, then refinement passes until a pass returns
    its input unchanged or max_iterations passes have run. A row that has reached its fixed point leaves the batch:
    later passes run only on the rows still changing."""
    if max_iterations < 0:
        raise InputError(f"max_iterations must be >= 0, got {max_iterations}")
    memory = model.backbone.encode(src_ids, src_mask)
    lengths = model.backbone.length_logits(memory, src_mask).argmax(-1) + 1  # class i is length i + 1
    tokens, target_mask = initial_pass(model, src_ids, src_mask, memory, lengths)
    passes = torch.zeros(len(tokens), dtype=torch.long, device=tokens.device)
    active = torch.ones(len(tokens), dtype=torch.bool, device=tokens.device)
    for _ in range(max_iterations):
        rows = active.nonzero().squeeze(1)
        if len(rows) == 0:
            break
        refined = refinement_pass(model, tokens[rows], target_mask[rows], memory[rows], src_mask[rows])
        passes[rows] += 1
        unchanged = (refined == tokens[rows]).all(dim=1)
        tokens[rows] = refined
        active[rows[unchanged]] = False
    sequences = [row[row_mask].tolist() for row, row_mask in zip(tokens, target_mask)]
    return Refinement(sequences, passes.tolist(), (~active).tolist())  # max_iterations 0: none was checked
