"""Shared by the tests of model loading and weight formats."""

import pytest


@pytest.fixture
def tiny_folder(tmp_path, monkeypatch, make_tiny_model, tokenizer):
    """A tiny fp32 model saved as a folder, with a cache of its own for what loading converts."""
    monkeypatch.setenv("ACCELGEN_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "tiny"
    make_tiny_model("qwen2", seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
