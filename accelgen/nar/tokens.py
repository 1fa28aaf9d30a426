"""Token ids for the NAR models: a Hugging Face tokenizer's pieces (the project's SmolLM2 tokenizer, vocabulary
49152), optionally restricted to a compact vocabulary of the pieces the training data uses most, so that tiny
models do not spend their parameters and time on 49k embeddings they never see.

Compact ids 0-4 are the specials every method needs (pad, bos, eos, mask, unk); the tokenizer's pieces follow in
order of frequency. A piece outside the vocabulary encodes as unk and decodes to nothing.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from accelgen.atomic import read_checked, write_json_atomically
from accelgen.errors import InputError

SPECIALS = ("<pad>", "<bos>", "<eos>", "<mask>", "<unk>")
PAD, BOS, EOS, MASK, UNK = range(len(SPECIALS))
# never a model's output: padding, the decoder's start, CMLM's placeholder, and a piece it cannot spell
NEVER_GENERATED = (PAD, BOS, MASK, UNK)


class Vocabulary:
    """Compact ids <-> a tokenizer's ids. tokenizer_ids[i] is the tokenizer's id of compact id len(SPECIALS) + i."""

    def __init__(self, tokenizer, tokenizer_ids: list[int]):
        self.tokenizer = tokenizer
        self.tokenizer_ids = list(tokenizer_ids)
        self.compact_of = {piece: len(SPECIALS) + index for index, piece in enumerate(self.tokenizer_ids)}
        if len(self.compact_of) != len(self.tokenizer_ids):
            raise InputError("a vocabulary's tokenizer ids must be distinct")

    @classmethod
    def full(cls, tokenizer) -> Vocabulary:
        """Every piece of the tokenizer."""
        return cls(tokenizer, list(range(len(tokenizer))))

    @classmethod
    def from_texts(cls, tokenizer, texts: list[str], size: int) -> Vocabulary:
        """The size - 5 pieces most frequent in texts (ties: the lower tokenizer id first), plus the specials."""
        if size <= len(SPECIALS):
            raise InputError(f"a vocabulary needs more than the {len(SPECIALS)} specials, got size {size}")
        counts = Counter(piece for text in texts for piece in tokenizer.encode(text, add_special_tokens=False))
        ranked = sorted(counts, key=lambda piece: (-counts[piece], piece))
        return cls(tokenizer, ranked[:size - len(SPECIALS)])

    def __len__(self) -> int:
        return len(SPECIALS) + len(self.tokenizer_ids)

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        """Compact ids of text's pieces (no bos or eos), the first max_length of them when given."""
        return self.encode_all([text], max_length)[0]

    def encode_all(self, texts: list[str], max_length: int | None = None) -> list[list[int]]:
        """encode() of each text, the tokenizer run over all of them at once (a fast tokenizer batches)."""
        if not texts:
            return []
        pieces = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return [[self.compact_of.get(piece, UNK) for piece in row[:max_length]] for row in pieces]

    def decode(self, ids: list[int]) -> str:
        """The text of ids up to the first eos; specials (and unknown pieces) decode to nothing."""
        pieces = []
        for index in ids:
            if index == EOS:
                break
            if index >= len(SPECIALS):
                pieces.append(self.tokenizer_ids[index - len(SPECIALS)])
        return self.tokenizer.decode(pieces)

    def save(self, path: Path) -> Path:
        return write_json_atomically(path, {"specials": list(SPECIALS), "tokenizer_ids": self.tokenizer_ids})

    @classmethod
    def load(cls, path: Path, tokenizer) -> Vocabulary:
        saved = read_checked(path, lambda file: json.loads(file.read_text()),
                             "delete it and build the vocabulary again")
        if saved.get("specials") != list(SPECIALS):
            raise InputError(f"{path} is not a vocabulary of this version (its specials are {saved.get('specials')})")
        return cls(tokenizer, saved["tokenizer_ids"])


def length_mask(lengths: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """lengths (N,) -> mask (N, width) bool, True on each row's first lengths[i] positions (width: the longest)."""
    width = max(int(lengths.max()), 1) if width is None else width
    return torch.arange(width, device=lengths.device) < lengths.unsqueeze(1)


def fixed_length_tokens(logits: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """logits (B, T, V), target_mask (B, T) -> tokens (B, T): each real position's most likely token, never a
    special nor EOS (the length is decided before the pass); PAD at padding."""
    allowed = logits.detach().clone()
    allowed[..., list(NEVER_GENERATED) + [EOS]] = float("-inf")
    return allowed.argmax(-1) * target_mask


def pad_sequences(sequences: list[list[int]], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (N, width), mask (N, width) bool, True on real tokens): sequences right-padded with PAD to width
    (default: the longest)."""
    width = max(map(len, sequences), default=0) if width is None else width
    ids = torch.full((len(sequences), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, sequence in enumerate(sequences):
        kept = sequence[:width]
        ids[row, :len(kept)] = torch.tensor(kept, dtype=torch.long)
        mask[row, :len(kept)] = True
    return ids, mask


def encode_pairs(vocabulary: Vocabulary, pairs: list[tuple[str, str]], max_source_len: int,
                 max_target_len: int) -> dict[str, torch.Tensor]:
    """A corpus of (source, summary) pairs as the padded rows every trainer reads: {"src", "src_mask" (N, S),
    "tgt", "tgt_mask" (N, T)}: sources cut to their first max_source_len pieces, summaries to their first
    max_target_len (no EOS: the methods that need one append it). Pairs with an empty side are dropped (no model
    can read or write nothing)."""
    sources, targets = [], []
    source_texts, summaries = [source for source, _ in pairs], [summary for _, summary in pairs]
    for source_ids, target_ids in zip(vocabulary.encode_all(source_texts, max_source_len),
                                      vocabulary.encode_all(summaries, max_target_len)):
        if source_ids and target_ids:
            sources.append(source_ids)
            targets.append(target_ids)
    if not sources:
        raise InputError("no pair has both a source and a summary to encode")
    src, src_mask = pad_sequences(sources)
    tgt, tgt_mask = pad_sequences(targets)
    return {"src": src, "src_mask": src_mask, "tgt": tgt, "tgt_mask": tgt_mask}


def append_eos(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (N, T), mask (N, T) -> (N, T + 1) with EOS right after each row's last real token."""
    ids = torch.cat([ids, torch.full_like(ids[:, :1], PAD)], dim=1)
    mask = torch.cat([mask, torch.zeros_like(mask[:, :1])], dim=1)
    lengths = mask.sum(dim=1)
    ids[torch.arange(len(ids)), lengths] = EOS
    mask[torch.arange(len(ids)), lengths] = True
    return ids, mask


def shift_right(ids: torch.Tensor, places: int = 1) -> torch.Tensor:
    """ids (N, T) -> (N, T): `places` BOS tokens, then ids[:, :-places]: a decoder's inputs when position i predicts
    ids[:, i] from the tokens `places` or more positions before it (1: autoregressive; K: SAT's groups)."""
    places = min(places, ids.shape[1])  # a group longer than the sequence: all BOS
    bos = torch.full_like(ids[:, :places], BOS)
    return torch.cat([bos, ids[:, :ids.shape[1] - places]], dim=1)


def trim_padding(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """rows with the padding columns that no row uses cut from src/src_mask and tgt/tgt_mask (other tensors are
    left as they are: trim before adding any that follow these widths)."""
    trimmed = dict(rows)
    for ids, mask in (("src", "src_mask"), ("tgt", "tgt_mask")):
        width = max(int(rows[mask].sum(dim=1).max()), 1)
        trimmed[ids], trimmed[mask] = rows[ids][:, :width], rows[mask][:, :width]
    return trimmed
