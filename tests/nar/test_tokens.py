"""The compact vocabulary over SmolLM2's tokenizer and the padded rows built with it."""

from __future__ import annotations

import pytest
import torch

from accelgen.nar.tokens import (BOS, EOS, PAD, SPECIALS, UNK, Vocabulary, append_eos, encode_pairs, pad_sequences,
                                 shift_right, trim_padding)


def test_a_compact_vocabulary_keeps_the_most_frequent_pieces(smollm_tokenizer):
    texts = ["return value", "return value", "return other"]
    vocabulary = Vocabulary.from_texts(smollm_tokenizer, texts, size=len(SPECIALS) + 2)
    assert len(vocabulary) == 7
    pieces = [smollm_tokenizer.decode([piece]) for piece in vocabulary.tokenizer_ids]
    assert pieces == ["return", " value"]  # " other" is rarer
    assert vocabulary.encode("return value") == [5, 6]
    assert vocabulary.encode("return other") == [5, UNK]
    assert vocabulary.decode([5, 6, EOS, 5]) == "return value"  # up to EOS
    assert vocabulary.decode([BOS, 5, UNK, PAD, 6]) == "return value"  # specials and unknown pieces: nothing
    with pytest.raises(ValueError, match="more than the 5 specials"):
        Vocabulary.from_texts(smollm_tokenizer, texts, size=5)


def test_the_full_vocabulary_spells_any_text_and_vocabularies_load_back(smollm_tokenizer, tmp_path):
    full = Vocabulary.full(smollm_tokenizer)
    assert len(full) == 49152 + len(SPECIALS)
    text = "def area(width, height):\n    return width * height  # é"
    assert UNK not in full.encode(text) and full.decode(full.encode(text)) == text
    assert full.encode(text, max_length=3) == full.encode(text)[:3]
    small = Vocabulary.from_texts(smollm_tokenizer, [text], 20)
    loaded = Vocabulary.load(small.save(tmp_path / "vocabulary.json"), smollm_tokenizer)
    assert loaded.tokenizer_ids == small.tokenizer_ids and loaded.encode(text) == small.encode(text)


def test_pairs_become_padded_rows_with_room_for_eos(smollm_tokenizer):
    vocabulary = Vocabulary.full(smollm_tokenizer)
    pairs = [("def f(): pass", "Do nothing at all today."), ("x = 1", ""), ("def g(a, b, c, d): return a", "Return a.")]
    rows = encode_pairs(vocabulary, pairs, max_source_len=6, max_target_len=3)
    assert len(rows["src"]) == 2  # the pair without a summary is dropped
    assert rows["src"].shape == (2, 6) and rows["tgt"].shape[1] == 3  # summaries keep max_target_len pieces
    assert rows["tgt_mask"].sum(dim=1).tolist() == [3, len(vocabulary.encode("Return a."))]
    assert vocabulary.decode(rows["tgt"][1][rows["tgt_mask"][1]].tolist()) == "Return a."


def test_sequence_helpers():
    ids, mask = pad_sequences([[7, 8, 9], [7]])
    assert ids.tolist() == [[7, 8, 9], [7, PAD, PAD]] and mask.tolist() == [[True] * 3, [True, False, False]]
    with_eos, eos_mask = append_eos(ids, mask)
    assert with_eos.tolist() == [[7, 8, 9, EOS], [7, EOS, PAD, PAD]]
    assert eos_mask.sum(dim=1).tolist() == [4, 2]
    assert shift_right(with_eos).tolist() == [[BOS, 7, 8, 9], [BOS, 7, EOS, PAD]]
    assert shift_right(with_eos, 3).tolist() == [[BOS, BOS, BOS, 7], [BOS, BOS, BOS, 7]]
    assert shift_right(with_eos, 6).tolist() == [[BOS] * 4, [BOS] * 4]
    rows = {"src": torch.tensor([[5, 6, PAD, PAD]]), "src_mask": torch.tensor([[True, True, False, False]]),
            "tgt": ids[1:], "tgt_mask": mask[1:]}
    trimmed = trim_padding(rows)
    assert trimmed["src"].tolist() == [[5, 6]] and trimmed["tgt"].tolist() == [[7]]
