"""Non-autoregressive Transformer (Gu, Bradbury, Xiong, Li & Socher 2018, "Non-Autoregressive Neural Machine
Translation"): every target token in one decoder pass.

The decoder cannot read its own outputs, so its inputs are copies of the source's embeddings: each source token
is copied as many times as its fertility (how many target tokens it accounts for), and the number of copies is
the target length. A fertility head on the encoder predicts each source token's fertility (0..max_fertility).
In training the fertilities come from an alignment of source and target (Gu et al. use an external aligner; here
`lexical_alignment`, until a teacher's attention provides one); without fertilities ("uniform" decoder inputs)
the length predictor decides the length and position t copies the source position t·S/T (Gu et al.'s uniform
copy baseline).

Noisy parallel decoding (NPD, section 3.3): sample several fertility (or length) candidates, the argmax among
them, decode all of them in one parallel pass, let an autoregressive teacher score every candidate in one
batched pass, and return the candidate it scores best.

The self-attention of the decoder is unmasked: every target position sees every other (Gu et al. also mask each
position from itself and add a positional attention; neither is needed for the algorithm and both are left out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from accelgen.errors import InputError
from accelgen.nar.backbone import BackboneConfig, MethodModel, length_loss, masked_cross_entropy
from accelgen.nar.tokens import EOS, NEVER_GENERATED

DECODER_INPUTS = ("fertility", "uniform")
# scorer(src (N, S), src_mask (N, S), candidates (N, T), candidate_mask (N, T)) -> log-probs (N,)
Scorer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# --- alignments and copies (pure functions) -----------------------------------------------------------------------


def uniform_positions(source_length: int, target_length: int) -> list[int]:
    """The source position each target position copies under uniform copy: the centre of its share, t·S/T."""
    return [min(int((t + 0.5) * source_length / target_length), source_length - 1) for t in range(target_length)]


def uniform_fertilities(source_lengths: torch.Tensor, target_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """source_lengths, target_lengths (B,) -> fertilities (B, width) whose copies are the uniform copy."""
    rows = len(source_lengths)
    fertility = torch.zeros(rows, width, dtype=torch.long, device=source_lengths.device)
    for row in range(rows):
        for position in uniform_positions(int(source_lengths[row]), int(target_lengths[row])):
            fertility[row, position] += 1
    return fertility


def lexical_alignment(source: list[int], target: list[int], max_fertility: int) -> list[int]:
    """The source position each target token is aligned to: an identical source token (the one nearest the
    target's uniform position), else the uniform position itself. A source position holds at most max_fertility
    target tokens; a token that finds it full goes to the nearest position with room."""
    if len(target) > len(source) * max_fertility:
        raise InputError(f"a target of {len(target)} tokens cannot be aligned to {len(source)} source tokens of "
                         f"fertility at most {max_fertility}: raise max_fertility")
    where: dict[int, list[int]] = {}
    for position, piece in enumerate(source):
        where.setdefault(piece, []).append(position)
    load = [0] * len(source)
    alignment = []
    for piece, centre in zip(target, uniform_positions(len(source), len(target))):
        same = [position for position in where.get(piece, []) if load[position] < max_fertility]
        if same:
            chosen = min(same, key=lambda position: (abs(position - centre), position))
        else:
            chosen = min((position for position in range(len(source)) if load[position] < max_fertility),
                         key=lambda position: (abs(position - centre), position))
        load[chosen] += 1
        alignment.append(chosen)
    return alignment


def lexical_fertilities(src_ids: torch.Tensor, src_mask: torch.Tensor, tgt_ids: torch.Tensor, tgt_mask: torch.Tensor,
                        max_fertility: int) -> torch.Tensor:
    """src (B, S), tgt (B, T) -> fertilities (B, S): how many target tokens lexical_alignment gives each source
    token (each row sums to its target's length)."""
    fertility = torch.zeros_like(src_ids)
    for row in range(len(src_ids)):
        source, target = src_ids[row][src_mask[row]].tolist(), tgt_ids[row][tgt_mask[row]].tolist()
        for position in lexical_alignment(source, target, max_fertility):
            fertility[row, position] += 1
    return fertility


def copy_positions(fertility: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fertility (B, S) -> (positions (B, T), mask (B, T)): decoder position t copies source position
    positions[:, t] (source i repeated fertility[:, i] times, in source order); T = width or the largest total,
    longer copies cut at T."""
    ends = fertility.cumsum(dim=1)  # source i fills decoder positions ends[i-1] .. ends[i]-1
    width = width if width is not None else max(int(ends[:, -1].max()), 1)
    steps = torch.arange(width, device=fertility.device).expand(len(fertility), width).contiguous()
    positions = torch.searchsorted(ends, steps, right=True).clamp(max=fertility.shape[1] - 1)
    return positions, steps < ends[:, -1:]


# --- the model -------------------------------------------------------------------------------------------------


class NATModel(MethodModel):
    method = "nat"

    def __init__(self, config: BackboneConfig, decoder_inputs: str = "fertility", max_fertility: int = 4):
        super().__init__(config)
        if decoder_inputs not in DECODER_INPUTS:
            raise InputError(f"decoder_inputs must be one of {DECODER_INPUTS}, got {decoder_inputs!r}")
        if max_fertility < 1:
            raise InputError(f"max_fertility must be >= 1, got {max_fertility}")
        self.decoder_inputs, self.max_fertility = decoder_inputs, max_fertility
        if decoder_inputs == "fertility":
            self.fertility_head = nn.Linear(config.width, max_fertility + 1)

    def options(self) -> dict:
        return {"decoder_inputs": self.decoder_inputs, "max_fertility": self.max_fertility}

    def training_inputs(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The batch with each source token's fertility (from lexical_alignment) unless it brings its own."""
        if self.decoder_inputs != "fertility" or "fertility" in batch:
            return batch
        fertility = lexical_fertilities(batch["src"], batch["src_mask"], batch["tgt"], batch["tgt_mask"],
                                        self.max_fertility)
        return {**batch, "fertility": fertility}

    def source_embeddings(self, src_ids: torch.Tensor) -> torch.Tensor:
        """src_ids (B, S) -> what the decoder copies of each source position (B, S, width): its embedding."""
        return self.backbone.embed_tokens(src_ids)

    def parallel_hidden(self, src_ids: torch.Tensor, src_mask: torch.Tensor, memory: torch.Tensor,
                        fertility: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder states (B, T, width) of every target position at once, the decoder reading source embeddings
        copied by fertility (B, S); and the target mask (B, T)."""
        positions, target_mask = copy_positions(fertility, width)
        source_embeddings = self.source_embeddings(src_ids)  # (B, S, width)
        inputs = source_embeddings.gather(1, positions.unsqueeze(-1).expand(-1, -1, source_embeddings.shape[-1]))
        return self.backbone.decode(inputs, target_mask, memory, src_mask), target_mask  # no attention mask

    def parallel_logits(self, src_ids: torch.Tensor, src_mask: torch.Tensor, memory: torch.Tensor,
                        fertility: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits (B, T, V) of every target position at once; and the target mask (B, T)."""
        hidden, target_mask = self.parallel_hidden(src_ids, src_mask, memory, fertility, width)
        return self.backbone.logits(hidden), target_mask

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """The targets' cross-entropy given the decoder inputs of the true fertilities (or the uniform copy of the
        true length), plus the fertility head's (or length predictor's) cross-entropy."""
        src, src_mask, tgt, tgt_mask = batch["src"], batch["src_mask"], batch["tgt"], batch["tgt_mask"]
        memory = self.backbone.encode(src, src_mask)
        if self.decoder_inputs == "fertility":
            fertility = batch["fertility"]
            if not torch.equal(fertility.sum(dim=1), tgt_mask.sum(dim=1)):
                raise InputError("each row's fertilities must sum to its target's length")
            fertility_logits = self.fertility_head(memory)  # (B, S, max_fertility + 1)
            guide = masked_cross_entropy(fertility_logits, fertility.clamp(max=self.max_fertility), src_mask)
        else:
            fertility = uniform_fertilities(src_mask.sum(dim=1), tgt_mask.sum(dim=1), src.shape[1])
            guide = length_loss(self.backbone, memory, src_mask, tgt_mask)
        logits, _ = self.parallel_logits(src, src_mask, memory, fertility, width=tgt.shape[1])
        tokens = masked_cross_entropy(logits, tgt, tgt_mask)
        return tokens + guide, {"token_loss": float(tokens.detach()), "guide_loss": float(guide.detach())}

    def fertility_candidates(self, memory: torch.Tensor, src_mask: torch.Tensor, count: int = 1,
                             temperature: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
        """(B, count, S) fertilities: candidate 0 the most likely, the others sampled from the fertility head (or,
        with uniform decoder inputs, uniform copies of sampled lengths). Every candidate has at least one token."""
        rows, width = src_mask.shape
        if self.decoder_inputs == "fertility":
            logits = self.fertility_head(memory)  # (B, S, F + 1)
            best = logits.argmax(-1).unsqueeze(1)
            probabilities = (logits / temperature).softmax(-1).flatten(0, 1)  # (B * S, F + 1)
            sampled = torch.multinomial(probabilities, count - 1, replacement=True, generator=generator) \
                if count > 1 else probabilities.new_zeros(rows * width, 0, dtype=torch.long)
            fertility = torch.cat([best, sampled.view(rows, width, count - 1).permute(0, 2, 1)], dim=1)
            fertility = fertility * src_mask.unsqueeze(1)
            fertility[..., 0] += (fertility.sum(-1) == 0).long()  # an empty candidate: the first token, once
            return fertility
        logits = self.backbone.length_logits(memory, src_mask)  # (B, max_target_len)
        best = logits.argmax(-1, keepdim=True)
        sampled = torch.multinomial((logits / temperature).softmax(-1), count - 1, replacement=True,
                                    generator=generator) if count > 1 else best[:, :0]
        lengths = torch.cat([best, sampled], dim=1) + 1  # (B, count)
        sources = src_mask.sum(dim=1).repeat_interleave(count)
        return uniform_fertilities(sources, lengths.flatten(), width).view(rows, count, width)

    def decode_fertilities(self, src_ids: torch.Tensor, src_mask: torch.Tensor, memory: torch.Tensor,
                           fertility: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One parallel pass: (tokens (B, T), mask (B, T)), each position's most likely token given fertility (B, S)
        (its total, at most max_target_len, is the length)."""
        width = min(max(int(fertility.sum(dim=1).max()), 1), self.config.max_target_len)
        logits, target_mask = self.parallel_logits(src_ids, src_mask, memory, fertility, width)
        logits[..., list(NEVER_GENERATED) + [EOS]] = float("-inf")  # the length is decided: no EOS either
        return logits.argmax(-1) * target_mask, target_mask

    @torch.no_grad()
    def generate(self, src_ids: torch.Tensor, src_mask: torch.Tensor) -> list[list[int]]:
        """The target ids of each source (B, S): its most likely fertilities, then one parallel pass."""
        memory = self.backbone.encode(src_ids, src_mask)
        fertility = self.fertility_candidates(memory, src_mask)[:, 0]
        tokens, mask = self.decode_fertilities(src_ids, src_mask, memory, fertility)
        return [row[row_mask].tolist() for row, row_mask in zip(tokens, mask)]


# --- noisy parallel decoding ---------------------------------------------------------------------------------------


@dataclass
class NoisyParallelDecoding:
    sequences: list[list[int]]  # per source: the candidate the scorer scored best
    candidates: list[list[list[int]]]  # per source: every candidate, the most likely fertilities' first
    scores: torch.Tensor  # (B, candidates): the scorer's log-probs


@torch.no_grad()
def noisy_parallel_decode(model: NATModel, src_ids: torch.Tensor, src_mask: torch.Tensor, scorer: Scorer,
                          samples: int = 8, temperature: float = 1.0,
                          generator: torch.Generator | None = None) -> NoisyParallelDecoding:
    """Gu et al.'s NPD: `samples` fertility candidates per source (B, S), all decoded in one parallel pass and
    scored by scorer in one batched call; each source's best-scored candidate wins."""
    memory = model.backbone.encode(src_ids, src_mask)
    fertility = model.fertility_candidates(memory, src_mask, samples, temperature, generator)  # (B, n, S)
    rows, count = fertility.shape[:2]
    repeated_src, repeated_mask = src_ids.repeat_interleave(count, 0), src_mask.repeat_interleave(count, 0)
    tokens, token_mask = model.decode_fertilities(repeated_src, repeated_mask, memory.repeat_interleave(count, 0),
                                                  fertility.flatten(0, 1))
    scores = scorer(repeated_src, repeated_mask, tokens, token_mask).view(rows, count)
    flat = [row[mask].tolist() for row, mask in zip(tokens, token_mask)]
    candidates = [flat[row * count:(row + 1) * count] for row in range(rows)]
    best = scores.argmax(dim=1).tolist()
    return NoisyParallelDecoding([candidates[row][best[row]] for row in range(rows)], candidates, scores)
