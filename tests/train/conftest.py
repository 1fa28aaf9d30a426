"""Shared by the training tests: a tiny model saved as a folder (what the train commands load) and a small
JSONL dataset for them."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def command_inputs(make_tiny_model, tokenizer, tmp_path):
    """command_inputs(seed, layers) -> (model folder, "jsonl:FILE" dataset of 80 short texts)."""

    def make(seed: int, layers: int = 2):
        folder, texts = tmp_path / "tiny", tmp_path / "texts.jsonl"
        make_tiny_model("qwen2", seed=seed, layers=layers).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        texts.write_text("".join(json.dumps({"text": f"line {i}: the quick brown fox"}) + "\n" for i in range(80)))
        return folder, f"jsonl:{texts}"

    return make
