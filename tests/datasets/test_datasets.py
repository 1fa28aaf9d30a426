"""Dataset loaders on small fixture files, plus the packaged HumanEval and ShareGPT data."""

from __future__ import annotations

import json

import pytest

import accelgen.datasets as datasets
from accelgen.datasets import Prompt, iter_json_array, load_dataset, prompt_token_ids, take_balanced


def write_jsonl(path, items):
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


@pytest.fixture
def specbench_file(tmp_path):
    """A Spec-Bench question.jsonl: three categories, grouped as in the real file, with a second turn."""
    questions = [{"question_id": 81 + i, "category": "writing", "turns": [f"write {i}", "and again"]} for i in range(3)]
    questions += [{"question_id": 91 + i, "category": "math", "turns": [f"solve {i}"]} for i in range(2)]
    questions += [{"question_id": 101, "category": "translation", "turns": ["translate this"], "reference": ["x"]}]
    return write_jsonl(tmp_path / "question.jsonl", questions)


def test_specbench_first_turns_as_chat_balanced_over_categories(specbench_file):
    prompts = load_dataset(f"specbench:{specbench_file}")
    assert [p.id for p in prompts] == ["81", "91", "101", "82", "92", "83"]
    assert prompts[0] == Prompt("81", "writing", "write 0", chat=True)
    limited = load_dataset(f"specbench:{specbench_file}", limit=4)
    assert [p.category for p in limited] == ["writing", "math", "translation", "writing"]


SPECBENCH_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
                        "translation", "summarization", "qa", "math_reasoning", "rag"]


def test_the_projects_specbench_file_is_the_default(monkeypatch, tmp_path):
    """`specbench` alone: the project's question.jsonl in Spec-Bench's format, every category at least twice."""
    rows = [json.loads(line) for line in datasets.SPECBENCH_FILE.read_text().splitlines()]
    assert all(set(row) == {"question_id", "category", "turns"} and isinstance(row["question_id"], int)
               and row["turns"] and all(isinstance(turn, str) and turn for turn in row["turns"]) for row in rows)
    prompts = load_dataset("specbench")
    assert prompts == load_dataset(f"specbench:{datasets.SPECBENCH_FILE}")
    assert sorted(p.id for p in prompts) == sorted(str(row["question_id"]) for row in rows)
    assert sorted(p.category for p in load_dataset("specbench", limit=13)) == sorted(SPECBENCH_CATEGORIES)
    assert all(sum(p.category == category for p in prompts) >= 2 for category in SPECBENCH_CATEGORIES)
    assert all(p.chat for p in prompts)
    monkeypatch.setattr(datasets, "SPECBENCH_FILE", tmp_path / "absent.jsonl")  # an installed package, no checkout
    with pytest.raises(FileNotFoundError, match="specbench:<question.jsonl>"):
        load_dataset("specbench")


def test_specbench_category_filter_and_unknown_category(specbench_file):
    prompts = load_dataset(f"specbench:{specbench_file}", categories=["math", "translation"])
    assert {p.category for p in prompts} == {"math", "translation"}
    with pytest.raises(ValueError, match="no category 'poetry'.*writing, math, translation"):
        load_dataset(f"specbench:{specbench_file}", categories=["poetry"])


def test_specbench_rejects_a_question_without_turns(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question_id": 1, "category": "qa"}])
    with pytest.raises(ValueError, match=r"q.jsonl:1: .* needs turns"):
        load_dataset(f"specbench:{path}")


def test_jsonl_prompt_is_raw_text_and_turns_are_chat(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [{"prompt": "def f():"}, {"turns": ["Hello?"], "id": "greeting", "category": "chat"}])
    raw, chat = load_dataset(f"jsonl:{path}")
    assert raw == Prompt("1", "jsonl", "def f():", chat=False)
    assert chat == Prompt("greeting", "chat", "Hello?", chat=True)


@pytest.mark.parametrize("line, message", [
    ('{"text": "x"}', 'needs "prompt"'),
    ("not json", "not valid JSON"),
    ('{"turns": []}', "non-empty list"),
])
def test_jsonl_bad_lines_are_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        load_dataset(f"jsonl:{path}")


def test_duplicate_ids_are_an_error(tmp_path):
    path = write_jsonl(tmp_path / "dup.jsonl", [{"prompt": "a", "id": 1}, {"prompt": "b", "id": 1}])
    with pytest.raises(ValueError, match="occurs twice"):
        load_dataset(f"jsonl:{path}")


@pytest.mark.parametrize("spec", ["nope", "sharegpt:extra", "humaneval:extra", "jsonl:"])
def test_unknown_dataset_spec(spec):
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset(spec)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset file not found"):
        load_dataset(f"jsonl:{tmp_path / 'absent.jsonl'}")


def test_take_balanced_keeps_order_within_categories():
    prompts = [Prompt(str(i), category, "", False) for i, category in enumerate("aaabbc")]
    assert [p.id for p in take_balanced(prompts, None)] == ["0", "3", "5", "1", "4", "2"]
    assert [p.id for p in take_balanced(prompts, 2)] == ["0", "3"]


def test_iter_json_array_across_chunk_boundaries(tmp_path):
    items = [{"id": i, "text": "é" * (i * 7)} for i in range(40)]
    path = tmp_path / "array.json"
    path.write_text(json.dumps(items, indent=2))
    assert list(iter_json_array(path, chunk_chars=16)) == items


def test_iter_json_array_truncated_file(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text('[{"id": 1}, {"id": 2}, {"id": 3, "te')
    with pytest.raises(ValueError, match="truncated"):
        list(iter_json_array(path, chunk_chars=8))
    assert list(iter_json_array(path, chunk_chars=8, truncated_ok=True)) == [{"id": 1}, {"id": 2}]


def test_sharegpt_sample_is_deterministic_and_filtered(tmp_path):
    sampled = [f"c{i}" for i in range(200) if datasets.sharegpt_sampled(f"c{i}")][:4]
    skipped = next(f"c{i}" for i in range(200) if not datasets.sharegpt_sampled(f"c{i}"))
    conversations = [
        {"id": sampled[0], "conversations": [{"from": "human", "value": "first"}, {"from": "gpt", "value": "answer"}]},
        {"id": skipped, "conversations": [{"from": "human", "value": "not in the sample"}]},
        {"id": sampled[1], "conversations": [{"from": "gpt", "value": "starts with the model"}]},
        {"id": sampled[2], "conversations": [{"from": "human", "value": "x" * (datasets.SHAREGPT_MAX_PROMPT_CHARS + 1)}]},
        {"id": sampled[3], "conversations": [{"from": "human", "value": "second"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    prompts = datasets.load_sharegpt(path)
    assert prompts == [Prompt(sampled[0], "sharegpt", "first", True), Prompt(sampled[3], "sharegpt", "second", True)]
    assert datasets.load_sharegpt(path, limit=1) == prompts[:1]


def test_packaged_humaneval_and_sharegpt():
    humaneval = load_dataset("humaneval", limit=3)
    assert [p.id for p in humaneval] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert not humaneval[0].chat and humaneval[0].text.startswith("from typing import List")
    sharegpt = load_dataset("sharegpt", limit=3)
    assert len(sharegpt) == 3 and all(p.chat and p.category == "sharegpt" for p in sharegpt)
    assert load_dataset("sharegpt", limit=3) == sharegpt


def test_sharegpt_train_holds_none_of_the_benchmarks_prompts():
    training = load_dataset("sharegpt-train", limit=200)
    assert len(training) == 200 and all(p.chat and p.category == "sharegpt" for p in training)
    assert not {p.id for p in training} & {p.id for p in load_dataset("sharegpt")}
    assert load_dataset("sharegpt-train", limit=5) == training[:5]


def test_datasets_joined_by_commas_give_their_texts_in_turn(tmp_path):
    from accelgen.cli.datastore import dataset_texts

    for name, count in (("a", 3), ("b", 1)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name}{i}"}) + "\n" for i in range(count)))
    joined = f"jsonl:{tmp_path / 'a.jsonl'},jsonl:{tmp_path / 'b.jsonl'}"
    assert list(dataset_texts(joined)) == ["a0", "b0", "a1", "a2"]
    assert list(dataset_texts(joined, limit=3)) == ["a0", "b0", "a1"]
    with pytest.raises(ValueError, match="unknown dataset 'nope'"):
        list(dataset_texts(f"{joined},nope"))


def test_humaneval_long_puts_solved_tasks_before_each_prompt():
    long = load_dataset("humaneval-long", limit=2)
    short = load_dataset("humaneval", limit=3)
    assert [p.id for p in long] == ["HumanEval/0/long", "HumanEval/1/long"] and not long[0].chat
    assert long[0].text.endswith("\n\n" + short[0].text) and long[0].text.startswith(short[1].text)
    assert len(long[0].text) > datasets.HUMANEVAL_LONG_CHARS


def test_prompt_token_ids_chat_and_raw(tokenizer):
    chat = Prompt("1", "c", "What is 2+2?", chat=True)
    text = tokenizer.decode(prompt_token_ids(tokenizer, chat))
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert prompt_token_ids(tokenizer, chat, "raw") == tokenizer("What is 2+2?").input_ids
    raw = Prompt("2", "c", "def f():", chat=False)
    assert prompt_token_ids(tokenizer, raw) == tokenizer("def f():").input_ids
    with pytest.raises(ValueError, match="unknown prompt format"):
        prompt_token_ids(tokenizer, raw, "markdown")
