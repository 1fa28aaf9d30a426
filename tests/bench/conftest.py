"""What the benchmark's tests share: a prompts file of one code completion and one chat turn."""

import json

import pytest


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"id": "code", "category": "coding", "prompt": "def add(a, b):\n    return a + b\n\ndef add"},
             {"id": "chat", "category": "writing", "turns": ["Write a haiku about the sea."]}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
