"""ENAT: NAT with enhanced decoder inputs (Guo, Tan, He, Qin, Xu & Liu 2019, "Non-Autoregressive Neural Machine
Translation with Enhanced Decoder Input", AAAI).

The NAT of Gu et al. (nat.py) feeds its decoder copies of the *source* embeddings, so the decoder has to translate
and generate in one pass from inputs that live on the wrong side. Guo et al. give it inputs that are already close
to the target, in one of two ways:

- phrase-table lookup (ENAT-P): a phrase table learnt from the training pairs by a statistical MT system (Moses)
  translates the source, phrase by phrase, into a rough target sentence; the decoder reads the target-side
  embeddings of those tokens, mapped uniformly onto the target length (Gu et al.'s uniform copy: target position t
  reads the translated token at the same fraction of the sentence). The lookup costs next to nothing at inference.
- embedding mapping (ENAT-E): a linear map f(e) = eW (W: width × width) carries the uniformly copied source
  embeddings into the target embedding space; it is trained end to end with the translation loss and regularised
  by a sentence-level alignment (the mapped source sentence's pooled representation pulled toward the target
  sentence's) and word-level adversarial learning (a discriminator tells mapped source word embeddings from
  target ones; the map learns to fool it).

Either way the decoder then predicts every target token in one pass, its self-attention unmasked. The paper
predicts the length as T_x + C (C a constant from the training data's statistics), decodes the lengths of a window
around it in parallel and lets an autoregressive teacher pick the best, and trains on an AR teacher's outputs
(sequence-level distillation).

How this implementation differs, and why:
- the "phrase table" is word to word: each source token's translation is the target token it is most often
  aligned to by nat.lexical_alignment over the training rows (ties: the lower id; a token never seen translates to
  itself). There is no SMT toolkit here, and on code -> summary the useful correspondences are mostly single
  identifiers. So the translated sentence has the source's length, and nat's uniform copy places it at the target
  length. The table is a buffer of the model (saved with it), fitted by `fit_phrase_table(rows)` before training.
- the embedding map is regularised by a supervised word-level alignment instead of the paper's two losses: each
  mapped source embedding is pulled (squared distance) toward the embedding of the target token that
  lexical_alignment aligns to it. The word-level adversary is left out: it needs a discriminator trained by its own
  optimiser in alternating steps, which the shared trainer's single loss and optimiser do not have, and a second
  network and schedule to tune for a regulariser. The sentence-level alignment is left out
  too: the word-level pairs pull every aligned position, which a pooled sentence distance only summarises.
  The target embeddings are a fixed goal (no gradient): source, target and output share one tied table here, and
  a loss that could move both sides could shrink the table itself. W starts as PyTorch's default random linear
  (not the identity), so it is learnt, not given.
- the length comes from the backbone's length predictor (trained with length_loss), not T_x + C: a function's
  length says little about its summary's. `generate` decodes the most likely length in one pass; an AR teacher's
  rescoring of several lengths is nat.noisy_parallel_decode, which takes this model as it is (ENAT is a NAT with
  uniform copy), with lengths sampled from the predictor rather than a window around T_x + C.
- no distillation: a model trains on the rows it is given.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from accelgen.errors import InputError
from accelgen.nar.backbone import BackboneConfig
from accelgen.nar.nat import NATModel, lexical_alignment

DECODER_INPUTS = ("phrase-table", "embedding-map")
DEFAULT_ALIGNMENT_WEIGHT = 1.0
UNFITTED = -1  # a phrase-table entry before fit_phrase_table


# --- lexical table and alignment (pure functions) ---------------------------------------------------------------


def target_alignment(src_ids: torch.Tensor, src_mask: torch.Tensor, tgt_ids: torch.Tensor,
                     tgt_mask: torch.Tensor) -> torch.Tensor:
    """src (B, S), tgt (B, T) -> (B, T): the source position lexical_alignment aligns each target token to (an
    identical source token nearest its uniform position, else the uniform position), with no fertility limit so
    that only the tokens decide; 0 on padding."""
    alignment = torch.zeros_like(tgt_ids)
    for row in range(len(src_ids)):
        source, target = src_ids[row][src_mask[row]].tolist(), tgt_ids[row][tgt_mask[row]].tolist()
        if source and target:
            alignment[row, :len(target)] = torch.tensor(lexical_alignment(source, target, len(target)))
    return alignment


def fit_lexical_table(src_ids: torch.Tensor, src_mask: torch.Tensor, tgt_ids: torch.Tensor, tgt_mask: torch.Tensor,
                      vocab_size: int) -> torch.Tensor:
    """The word-to-word "phrase table" of a corpus, src (N, S), tgt (N, T) -> (vocab_size,): entry x is the target
    token that target_alignment aligns to source token x most often (ties: the lower id); x itself when x is never
    aligned to anything."""
    for name, ids, mask in (("source", src_ids, src_mask), ("target", tgt_ids, tgt_mask)):
        real = ids[mask]
        if len(real) and (int(real.min()) < 0 or int(real.max()) >= vocab_size):
            raise InputError(f"the {name} ids must lie in 0..{vocab_size - 1} (the model's vocabulary), found "
                             f"{int(real.min())}..{int(real.max())}")
    alignment = target_alignment(src_ids, src_mask, tgt_ids, tgt_mask)
    aligned_sources = src_ids.gather(1, alignment)[tgt_mask]  # the source token of every real target token
    pairs, counts = torch.unique(aligned_sources * vocab_size + tgt_ids[tgt_mask], return_counts=True)
    best: dict[int, tuple[int, int]] = {}  # source token -> (count, target token) of its best translation so far
    for pair, count in zip(pairs.tolist(), counts.tolist()):  # pairs ascend: a tie keeps the lower target id
        source, target = divmod(pair, vocab_size)
        if source not in best or count > best[source][0]:
            best[source] = (count, target)
    table = torch.arange(vocab_size)
    for source, (_, target) in best.items():
        table[source] = target
    return table


def word_alignment_loss(mapped_source: torch.Tensor, alignment: torch.Tensor, target_embeddings: torch.Tensor,
                        target_mask: torch.Tensor) -> torch.Tensor:
    """mapped_source (B, S, width), alignment (B, T) (a source position per target token), target_embeddings
    (B, T, width), target_mask (B, T) -> the mean over real target tokens of the squared distance (averaged over
    the width) between the mapped embedding of each token's aligned source position and its own embedding."""
    aligned = mapped_source.gather(1, alignment.unsqueeze(-1).expand(-1, -1, mapped_source.shape[-1]))
    distances = (aligned - target_embeddings).pow(2).mean(dim=-1)  # (B, T)
    return (distances * target_mask).sum() / target_mask.sum().clamp(min=1)


# --- the model -------------------------------------------------------------------------------------------------


class ENATModel(NATModel):
    """A NAT with uniform copy (length from the length predictor: NATModel's "uniform" decoder inputs, whose
    length candidates, decoding and loss it inherits) whose decoder reads enhanced embeddings: the translated
    tokens' ("phrase-table") or the linearly mapped source embeddings ("embedding-map")."""

    method = "enat"

    def __init__(self, config: BackboneConfig, decoder_inputs: str = "embedding-map",
                 alignment_weight: float | None = None):
        super().__init__(config, decoder_inputs="uniform")
        if decoder_inputs not in DECODER_INPUTS:
            raise InputError(f"decoder_inputs must be one of {DECODER_INPUTS}, got {decoder_inputs!r}")
        self.enhancement = decoder_inputs
        if decoder_inputs == "phrase-table":
            if alignment_weight is not None:
                raise InputError("alignment_weight weighs the embedding map's alignment loss: it applies to "
                                 "decoder_inputs='embedding-map' only")
            self.register_buffer("phrase_table", torch.full((config.vocab_size,), UNFITTED, dtype=torch.long))
        else:
            alignment_weight = DEFAULT_ALIGNMENT_WEIGHT if alignment_weight is None else alignment_weight
            if isinstance(alignment_weight, bool) or not isinstance(alignment_weight, (int, float)) \
                    or not math.isfinite(alignment_weight) or alignment_weight < 0:
                raise InputError(f"alignment_weight must be a finite number >= 0, got {alignment_weight!r}")
            alignment_weight = float(alignment_weight)
            self.source_map = nn.Linear(config.width, config.width, bias=False)  # the paper's f(e) = eW
        self.alignment_weight = alignment_weight

    def options(self) -> dict:
        return {"decoder_inputs": self.enhancement, "alignment_weight": self.alignment_weight}

    def fit_to_data(self, rows: dict[str, torch.Tensor], vocabulary) -> None:
        if self.enhancement == "phrase-table":
            self.fit_phrase_table(rows)

    def fit_phrase_table(self, rows: dict[str, torch.Tensor]) -> ENATModel:
        """Learn the phrase table from training rows ({"src", "src_mask", "tgt", "tgt_mask"}); call it before
        training (and again to refit). Returns the model."""
        if self.enhancement != "phrase-table":
            raise InputError(f"only decoder_inputs='phrase-table' has a phrase table, this model's are "
                             f"{self.enhancement!r}")
        table = fit_lexical_table(rows["src"], rows["src_mask"], rows["tgt"], rows["tgt_mask"],
                                  self.config.vocab_size)
        self.phrase_table.copy_(table)
        return self

    def translate(self, src_ids: torch.Tensor) -> torch.Tensor:
        """src_ids (B, S) -> (B, S): each source token's translation by the phrase table."""
        if self.enhancement != "phrase-table":
            raise InputError(f"only decoder_inputs='phrase-table' translates by a table, this model's are "
                             f"{self.enhancement!r}")
        if bool((self.phrase_table == UNFITTED).any()):
            raise InputError("the phrase table is not fitted: call model.fit_phrase_table(training rows) before "
                             "training or decoding")
        return self.phrase_table[src_ids]

    def source_embeddings(self, src_ids: torch.Tensor) -> torch.Tensor:
        """src_ids (B, S) -> the enhanced embedding of each source position (B, S, width), which the decoder
        reads uniformly copied: its translation's embedding, or its own embedding through the map."""
        if self.enhancement == "phrase-table":
            return self.backbone.embed_tokens(self.translate(src_ids))
        return self.source_map(self.backbone.embed_tokens(src_ids))

    def training_inputs(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The batch with "alignment" (B, T), each target token's source position (embedding-map only), unless it
        brings its own. Nothing is drawn at random."""
        if self.enhancement != "embedding-map" or "alignment" in batch:
            return batch
        return {**batch, "alignment": target_alignment(batch["src"], batch["src_mask"], batch["tgt"],
                                                       batch["tgt_mask"])}

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """The targets' cross-entropy given the enhanced inputs uniformly copied to the true length, plus the length
        predictor's cross-entropy (NATModel's uniform loss); with the embedding map, plus alignment_weight times
        the word-level alignment loss."""
        loss, metrics = super().loss(batch)
        metrics["length_loss"] = metrics.pop("guide_loss")
        if self.enhancement != "embedding-map":
            return loss, metrics
        if "alignment" not in batch:
            raise InputError("an embedding-map batch needs its 'alignment': pass it through model.training_inputs")
        mapped = self.source_embeddings(batch["src"])  # (B, S, width)
        goal = self.backbone.embed_tokens(batch["tgt"]).detach()  # a fixed goal: see the module's docstring
        alignment = word_alignment_loss(mapped, batch["alignment"], goal, batch["tgt_mask"])
        metrics["alignment_loss"] = float(alignment.detach())
        return loss + self.alignment_weight * alignment, metrics
