"""Fine-tuning an autoregressive decoder into a non-autoregressive one by curriculum learning (Guo, Tan, Xu, Qin,
Chen & Liu 2020, "Fine-Tuning by Curriculum Learning for Non-Autoregressive Neural Machine Translation", AAAI;
FCL-NAT), with the forward-backward pre-training and the attentive input transformation of DePA (Zhan, Chen, Chen,
Wang, Bai & Gao 2023, "DePA: Improving Non-autoregressive Translation with Dependency-Aware Decoder", IWSLT) as
options.

FCL-NAT, as the paper gives it: AR and NAR models share one architecture and differ in two places only, the
decoder's inputs (AR: BOS + the target shifted right; NAR: the source's embeddings copied uniformly over the target
length) and the decoder's self-attention mask (AR: causal; NAR: none). Training has three phases on one network:
(1) AR training; (2) curriculum fine-tuning, where at step i a share λ_i of the target positions take the NAR
input instead of the AR one (the token-level curriculum of the decoder input) and, drawn separately, a share λ_i
of the rows of the causal mask are replaced by NAR rows that see every position (the curriculum of the attention
mask), λ_i rising from 0 to 1 by a pacing function: linear, or logarithmic, λ_i = log(i) / log(I) over I stages,
which moves fast early and slowly near NAR (the default of the authors' code, with I = 200 stages); (3) NAR
training. Decoding is NAR: the length predictor picks the length, one decoder pass writes every token.

DePA adds two things to a NAT: (a) forward-backward dependency modelling, a pre-training of the decoder first as a
left-to-right AR decoder, then as a right-to-left one (position i predicts target i from the targets after it:
the upper-triangular mask), then NAT training, so that the NAT decoder starts from both directions' dependencies;
(b) an attentive transformation of the NAR decoder input from the source's embedding space into the target's:
x' = softmax(W_q x · Eᵀ) E, E the (gradient-free) embeddings of the target-side vocabulary. Here (a) is
`backward_steps` > 0 (left-to-right for `ar_steps`, then right-to-left for `backward_steps`, then the curriculum,
whose AR part is then right-to-left; curriculum_steps = 0 is DePA's direct switch), and (b) is
`input_transform=True`, its vocabulary fitted on the training targets (`fit_target_vocabulary`).

The schedule needs the training step, which `training_inputs(batch, generator)` is not given: the model keeps a
registered buffer, `trained_steps`, that `training_inputs` reads and advances once per call in training mode.
train_model calls it exactly once per optimizer step (in `draw(step)`, on every process), and the buffer is part
of the state_dict, so a checkpoint holds it and a resumed run continues the curriculum where it was; a held-out
loss (eval mode) neither reads nor advances it and measures the NAR objective, which is what decoding runs.
Drawing r from the generator instead would keep resume exact too, but would not be a curriculum.

Where this implementation differs, and why:
- positions and mask rows are drawn per sentence (round(λ·n) of its n positions); the authors' code draws one set
  of positions for the whole padded batch. Per-sentence masks are passed to the decoder as a (B·heads, T, T) mask;
- the decoder always covers the target and its EOS (T + 1 positions), in every phase, so that AR, mixed and NAR
  steps train the same positions; decoding copies over the predicted length + 1 and keeps the first positions;
- NAR rows see every position, themselves included (the shared NAT convention of nat.py; FCL-NAT's NAT also masks
  each position from itself and adds positional attention), and the copy is nat.py's uniform copy, not DePA's soft
  copy by attention;
- at an intermediate λ an NAR row sees the AR inputs of later positions, its own target among them, as in the
  authors' code: the intermediate tasks are easier than NAR, and the leak is gone at λ = 1;
- the right-to-left phase keeps each target token at its own position under an upper-triangular mask (DePA's code
  reverses the sequence instead), so that the positions mean the same in every phase and the curriculum can mix
  right-to-left rows with NAR ones;
- the mask follows the gradual row substitution of the authors' code (its substitute_mask path); their released
  defaults instead switch the mask at a fixed step and leave a whole batch AR with probability 1 − λ, and offer
  "ladder" and inverse-log paces too: none of those is offered here;
- one run, one optimizer: DePA resets the optimizer between its phases; no distillation, no label smoothing.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from accelgen.errors import InputError
from accelgen.nar.backbone import BackboneConfig, MethodModel, causal_mask, length_loss, masked_cross_entropy
from accelgen.nar.mask_predict import lowest_confidence_positions
from accelgen.nar.nat import copy_positions, uniform_fertilities
from accelgen.nar.tokens import BOS, EOS, NEVER_GENERATED, PAD, append_eos, length_mask, shift_right

PACINGS = ("linear", "logarithmic")
LOG_STAGES = 200  # I of the logarithmic pace, λ = log(i) / log(I): the authors' code's total_steps


# --- the schedule (pure functions) ----------------------------------------------------------------------------


def pace(progress: float, pacing: str) -> float:
    """The share λ of NAR positions at `progress` (0..1, clipped) through the curriculum: linear, or logarithmic
    log(1 + (I − 1)·progress) / log(I), the paper's log(i) / log(I) with stage i = 1 + (I − 1)·progress."""
    if pacing not in PACINGS:
        raise InputError(f"pacing must be one of {PACINGS}, got {pacing!r}")
    progress = min(max(progress, 0.0), 1.0)
    if pacing == "linear":
        return progress
    return math.log1p((LOG_STAGES - 1) * progress) / math.log(LOG_STAGES)


def curriculum_stage(step: int, ar_steps: int, backward_steps: int, curriculum_steps: int,
                     pacing: str) -> tuple[float, bool]:
    """(λ, backward) at training step `step` (0-based): left-to-right AR for ar_steps, right-to-left AR for
    backward_steps, then λ paced from 0 to 1 over curriculum_steps (its AR part right-to-left when there was a
    right-to-left phase), then NAR (λ = 1)."""
    if step < ar_steps:
        return 0.0, False
    backward = backward_steps > 0
    if step < ar_steps + backward_steps:
        return 0.0, True
    if curriculum_steps == 0:
        return 1.0, backward
    return pace((step - ar_steps - backward_steps) / curriculum_steps, pacing), backward


def curriculum_positions(target_mask: torch.Tensor, share: float, generator: torch.Generator) -> torch.Tensor:
    """target_mask (B, T) bool -> (B, T) bool: round(share·n) of each row's n real positions, uniformly at random
    (drawn from generator)."""
    counts = torch.floor(target_mask.sum(dim=1) * share + 0.5).long()
    random_order = torch.rand(target_mask.shape, generator=generator).to(target_mask.device)
    return lowest_confidence_positions(random_order, target_mask, counts)


def shift_left(targets: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """The right-to-left decoder's inputs: targets (B, T) ending in EOS, target_mask (B, T) -> (B, T), position i
    reading targets[:, i + 1], the last real position reading BOS (where the right-to-left decoder starts)."""
    following = torch.cat([targets[:, 1:], torch.full_like(targets[:, :1], PAD)], dim=1)
    next_real = torch.cat([target_mask[:, 1:], torch.zeros_like(target_mask[:, :1])], dim=1)
    return torch.where(target_mask & ~next_real, BOS, torch.where(target_mask, following, PAD))


def self_attention_mask(nar_queries: torch.Tensor, target_mask: torch.Tensor, backward: torch.Tensor) -> torch.Tensor:
    """nar_queries (B, T) bool (the rows that attend as NAR), target_mask (B, T) bool, backward (B,) bool ->
    (B, T, T) bool, True where position i must not see position j: an AR row is causal (j > i hidden), or
    anti-causal when backward (j < i hidden); an NAR row hides nothing. Padding rows hide nothing either: the key
    padding mask already hides padding keys, and a row that saw no key at all would come out NaN."""
    length = target_mask.shape[1]
    forward_rows = causal_mask(length, target_mask.device)
    ar_rows = torch.where(backward.view(-1, 1, 1), forward_rows.T, forward_rows)  # (B, T, T)
    return ar_rows & (target_mask & ~nar_queries).unsqueeze(-1)


def attentive_transform(queries: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """DePA's input transformation: queries (B, T, width) (the projected NAR inputs), table (K, width) (target-side
    embeddings) -> (B, T, width), each position a softmax(query · tableᵀ)-weighted sum of the table's rows."""
    return (queries @ table.T).softmax(dim=-1) @ table


# --- the model -------------------------------------------------------------------------------------------------


class CurriculumModel(MethodModel):
    method = "curriculum"

    def __init__(self, config: BackboneConfig, ar_steps: int = 400, backward_steps: int = 0,
                 curriculum_steps: int = 1000, pacing: str = "logarithmic", input_transform: bool = False):
        super().__init__(config)
        for name, value in (("ar_steps", ar_steps), ("backward_steps", backward_steps),
                            ("curriculum_steps", curriculum_steps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InputError(f"{name} must be an integer >= 0, got {value!r}")
        if pacing not in PACINGS:
            raise InputError(f"pacing must be one of {PACINGS}, got {pacing!r}")
        if not isinstance(input_transform, bool):
            raise InputError(f"input_transform must be True or False, got {input_transform!r}")
        self.ar_steps, self.backward_steps, self.curriculum_steps = ar_steps, backward_steps, curriculum_steps
        self.pacing, self.input_transform = pacing, input_transform
        # the schedule's clock: training_inputs advances it once per training step; saved, so resume is exact
        self.register_buffer("trained_steps", torch.zeros((), dtype=torch.long))
        if input_transform:
            self.transform_query = nn.Linear(config.width, config.width)
            vocabulary = torch.ones(config.vocab_size, dtype=torch.bool)
            vocabulary[list(NEVER_GENERATED)] = False  # until fitted: every token a target can hold
            self.register_buffer("target_vocabulary", vocabulary)

    def options(self) -> dict:
        return {"ar_steps": self.ar_steps, "backward_steps": self.backward_steps,
                "curriculum_steps": self.curriculum_steps, "pacing": self.pacing,
                "input_transform": self.input_transform}

    def stage(self) -> tuple[float, bool]:
        """(λ, backward) of the next training step."""
        return curriculum_stage(int(self.trained_steps), self.ar_steps, self.backward_steps, self.curriculum_steps,
                                self.pacing)

    def fit_to_data(self, rows: dict[str, torch.Tensor], vocabulary) -> None:
        if self.input_transform:
            self.fit_target_vocabulary(rows)

    def fit_target_vocabulary(self, rows: dict[str, torch.Tensor]) -> int:
        """Restrict the input transformation's table to the tokens of rows' targets ("tgt", "tgt_mask" (N, T)) and
        EOS (DePA's target-side vocabulary); call it on the training rows before training. Returns its size."""
        if not self.input_transform:
            raise InputError("fit_target_vocabulary is for input_transform=True: this model has no table")
        vocabulary = torch.zeros_like(self.target_vocabulary)
        vocabulary[rows["tgt"][rows["tgt_mask"]].to(vocabulary.device)] = True
        vocabulary[EOS] = True
        vocabulary[list(NEVER_GENERATED)] = False
        self.target_vocabulary.copy_(vocabulary)
        return int(vocabulary.sum())

    def training_inputs(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The batch with this step's curriculum draws over the target + EOS positions: "nar_inputs" and
        "nar_queries" (B, T + 1) bool (the positions reading the NAR input, the rows attending as NAR; two separate
        draws), "backward" (B,) bool. In training mode it is the step's draw and advances `trained_steps`; in eval
        mode (held-out losses) it draws the NAR task, λ = 1."""
        share, backward = self.stage() if self.training else (1.0, False)
        _, target_mask = append_eos(batch["tgt"], batch["tgt_mask"])
        nar_inputs = curriculum_positions(target_mask, share, generator)
        nar_queries = curriculum_positions(target_mask, share, generator)
        if self.training:
            self.trained_steps += 1
        return {**batch, "nar_inputs": nar_inputs, "nar_queries": nar_queries,
                "backward": torch.full((len(target_mask),), backward)}

    def target_embeddings(self) -> torch.Tensor:
        """(K, width): the embeddings of the target-side vocabulary, without gradient (DePA's table)."""
        ids = self.target_vocabulary.nonzero().squeeze(1)
        return self.backbone.embed_tokens(ids).detach()

    def nar_decoder_inputs(self, src_ids: torch.Tensor, src_mask: torch.Tensor,
                           target_mask: torch.Tensor) -> torch.Tensor:
        """src (B, S), target_mask (B, T) -> (B, T, width): the source embeddings uniformly copied over each row's
        T real positions, moved into the target embeddings' space when input_transform."""
        fertility = uniform_fertilities(src_mask.sum(dim=1), target_mask.sum(dim=1), src_ids.shape[1])
        positions, _ = copy_positions(fertility, width=target_mask.shape[1])
        source_embeddings = self.backbone.embed_tokens(src_ids)  # (B, S, width)
        copied = source_embeddings.gather(1, positions.unsqueeze(-1).expand(-1, -1, source_embeddings.shape[-1]))
        if self.input_transform:
            return attentive_transform(self.transform_query(copied), self.target_embeddings())
        return copied

    def curriculum_logits(self, src_ids: torch.Tensor, src_mask: torch.Tensor, memory: torch.Tensor,
                          targets: torch.Tensor, target_mask: torch.Tensor, nar_inputs: torch.Tensor,
                          nar_queries: torch.Tensor, backward: torch.Tensor) -> torch.Tensor:
        """The logits (B, T, V) of targets (B, T) ending in EOS, every position in one pass: a position reads the
        NAR input where nar_inputs (B, T), else the AR one (the target before it, or after it when backward (B,));
        a row attends as NAR where nar_queries (B, T), else causally in its direction."""
        ar_ids = torch.where(backward.unsqueeze(1), shift_left(targets, target_mask), shift_right(targets))
        inputs = torch.where(nar_inputs.unsqueeze(-1), self.nar_decoder_inputs(src_ids, src_mask, target_mask),
                             self.backbone.embed_tokens(ar_ids))
        mask = self_attention_mask(nar_queries, target_mask, backward)
        per_head = mask.repeat_interleave(self.config.heads, dim=0) if mask.any() else None  # (B·heads, T, T)
        return self.backbone.logits(self.backbone.decode(inputs, target_mask, memory, src_mask, per_head))

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """The target + EOS tokens' cross-entropy under the step's curriculum draws, plus the length predictor's
        (which decoding needs, trained from the first step)."""
        missing = [name for name in ("nar_inputs", "nar_queries", "backward") if name not in batch]
        if missing:
            raise InputError(f"the batch has no {missing}: pass it through training_inputs first")
        src, src_mask = batch["src"], batch["src_mask"]
        targets, target_mask = append_eos(batch["tgt"], batch["tgt_mask"])
        for name in ("nar_inputs", "nar_queries"):
            if batch[name].shape != targets.shape:
                raise InputError(f"{name} has shape {tuple(batch[name].shape)}, the target + EOS "
                                 f"{tuple(targets.shape)}: draw it with training_inputs on this batch")
        memory = self.backbone.encode(src, src_mask)
        logits = self.curriculum_logits(src, src_mask, memory, targets, target_mask, batch["nar_inputs"],
                                        batch["nar_queries"], batch["backward"])
        tokens = masked_cross_entropy(logits, targets, target_mask)
        lengths = length_loss(self.backbone, memory, src_mask, batch["tgt_mask"])
        nar_share = (batch["nar_inputs"] & target_mask).sum() / target_mask.sum()
        return tokens + lengths, {"token_loss": float(tokens.detach()), "length_loss": float(lengths.detach()),
                                  "nar_share": float(nar_share)}

    @torch.no_grad()
    def generate(self, src_ids: torch.Tensor, src_mask: torch.Tensor) -> list[list[int]]:
        """The target ids of each source (B, S): one NAR pass at the predicted length."""
        return parallel_decode(self, src_ids, src_mask)


@torch.no_grad()
def parallel_decode(model: CurriculumModel, src_ids: torch.Tensor, src_mask: torch.Tensor) -> list[list[int]]:
    """Each source's (B, S) most likely length N, then one decoder pass over N + 1 copied positions (the tokens and
    the EOS position the decoder was trained with, no attention mask): the argmax of the first N, specials and
    EOS excluded (the length is decided)."""
    backbone = model.backbone
    memory = backbone.encode(src_ids, src_mask)
    lengths = backbone.length_logits(memory, src_mask).argmax(dim=-1) + 1  # (B,) target tokens
    width = int(lengths.max()) + 1
    target_mask = length_mask(lengths + 1, width)  # (B, width)
    inputs = model.nar_decoder_inputs(src_ids, src_mask, target_mask)
    logits = backbone.logits(backbone.decode(inputs, target_mask, memory, src_mask))
    logits[..., list(NEVER_GENERATED) + [EOS]] = float("-inf")
    tokens = logits.argmax(dim=-1)
    return [row[:length].tolist() for row, length in zip(tokens, lengths.tolist())]
