"""`accelgen nar ...` and `accelgen train nar` end to end on a small mined corpus: data, distillation by a tiny
teacher (resumable), training (resumable), generation and the benchmark; and the errors a user can run into."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from accelgen.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")

SUMMARIES = ["Return the sum of two numbers.", "Open the file and read every line.", "Check whether the name is valid.",
             "Build a list of the given words.", "Convert the text to upper case."]


def write_packages(root, packages: int = 4, functions: int = 6) -> None:
    """Packages of small documented functions to mine (each function's source distinct)."""
    for package in range(packages):
        folder = root / f"package{package}"
        folder.mkdir(parents=True)
        body = "".join(textwrap.dedent(f'''
            def function_{package}_{index}(value, other=None):
                """{SUMMARIES[(package + index) % len(SUMMARIES)]}"""
                result = value + {package * 10 + index}
                return result
            ''') for index in range(functions))
        (folder / "module.py").write_text(body)


def invoke(*arguments: str):
    return CliRunner().invoke(app, [str(argument) for argument in arguments])


def said(result) -> str:
    """The command's output as one line (the console wraps long messages)."""
    return " ".join(result.output.split())


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root, folder = tmp_path_factory.mktemp("mined"), tmp_path_factory.mktemp("task")
    write_packages(root)
    result = invoke("nar", "data", "--out", folder, "--root", root, "--vocab-size", "300", "--held-out-fraction", "0.2",
                    "--workers", "1")
    assert result.exit_code == 0, result.output
    return folder


TINY = ["--width", "32", "--attention-heads", "2", "--encoder-layers", "1", "--decoder-layers", "1", "--feedforward", "64",
        "--max-source-len", "96", "--max-target-len", "12", "--batch-size", "8", "--eval-every", "2"]


@pytest.fixture(scope="module")
def trained(task, tmp_path_factory):
    """train_nar(method, *options) -> the folder of a tiny model trained 4 steps on the docstrings (once each)."""
    folders = {}

    def train(method: str, *options: str):
        if (method, options) not in folders:
            out = tmp_path_factory.mktemp(method)
            result = invoke("train", "nar", "--method", method, "--task", task, "--out", out, "--target", "docstring",
                            "--steps", "4", *TINY, *options)
            assert result.exit_code == 0, result.output
            folders[method, options] = out
        return folders[method, options]

    return train


def test_data_splits_by_package_and_keeps_the_tokenizer(task):
    summary = json.loads((task / "task.json").read_text())
    assert sum(summary["examples"].values()) == 24 and summary["packages"]["test"] >= 1
    packages = {split: {json.loads(line)["package"] for line in (task / f"{split}.jsonl").read_text().splitlines()}
                for split in ("train", "valid", "test")}
    assert not packages["train"] & packages["test"] and not packages["train"] & packages["valid"]
    assert (task / "tokenizer" / "tokenizer.json").is_file() and (task / "vocab.json").is_file()


def test_training_writes_a_model_that_generates_and_a_rerun_resumes(trained, task):
    folder = trained("sat", "--option", "group_size=2")
    training = json.loads((folder / "training.json").read_text())
    assert training["options"] == {"group_size": 2} and training["held_out_loss"][0][0] == 0
    assert len(training["held_out_loss"]) == 3  # before, at step 2, at step 4
    result = invoke("train", "nar", "--method", "sat", "--task", task, "--out", folder, "--target", "docstring",
                    "--steps", "4", *TINY, "--option", "group_size=2")
    assert result.exit_code == 0 and json.loads((folder / "training.json").read_text())["resumed_at"] == 4

    result = invoke("nar", "generate", "--model", folder, "--json", "def add(a, b):\n    return a + b\n")
    assert result.exit_code == 0, result.output
    output = json.loads(result.output)
    assert output["method"] == "sat" and isinstance(output["summary"], str) and len(output["token_ids"]) <= 12


@pytest.mark.parametrize("method, options", [("enat", ["--option", "decoder_inputs=phrase-table"]),
                                             ("bert-nar", []), ("synst", [])])
def test_methods_fitted_to_their_data_train_from_the_command_line(trained, method, options):
    folder = trained(method, *options)
    result = invoke("nar", "generate", "--model", folder, "def add(a, b):\n    return a + b\n")
    assert result.exit_code == 0, result.output


def test_the_benchmark_measures_every_model_against_the_ar_student(trained, task, tmp_path):
    ar, nat = trained("ar"), trained("nat", "--option", "decoder_inputs=uniform")
    out = tmp_path / "bench"
    result = invoke("nar", "bench", "--task", task, "--model", ar, "--model", nat, "--out", out, "--examples", "5",
                    "--latency-examples", "3", "--batch-size", "4")
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["teacher_references"] == 0  # no teacher summaries: the docstrings are the reference
    rows = {row["model"]: row for row in results["rows"]}
    assert set(rows) == {"ar", "nat", "nat+npd"} and rows["ar"]["speedup_latency"] == 1.0
    assert rows["nat"]["passes_mean"] == 1.0 and rows["ar"]["passes_mean"] >= 1.0
    assert rows["nat+npd"]["passes_mean"] == 2.0  # all candidates in one pass, the AR student's rescoring in one
    assert rows["nat+npd"]["rescored_by"] == "ar" and rows["nat"]["rescored_by"] is None
    assert rows["nat"]["latency_examples"] == 3 and rows["nat"]["examples"] == 5
    assert (out / "quality_speed.png").stat().st_size > 0 and "| nat |" in (out / "report.md").read_text()


@pytest.fixture
def teacher(task, make_tiny_model, tmp_path):
    """A tiny Qwen2 teacher folder speaking the task's tokenizer."""
    from transformers import AutoTokenizer

    folder = tmp_path / "teacher"
    make_tiny_model("qwen2", seed=0).save_pretrained(folder)
    AutoTokenizer.from_pretrained(task / "tokenizer").save_pretrained(folder)
    return folder


def test_the_benchmark_times_the_teacher_on_the_same_examples(trained, task, teacher, tmp_path):
    out = tmp_path / "bench"
    result = invoke("nar", "bench", "--task", task, "--model", trained("ar"), "--out", out, "--examples", "4",
                    "--latency-examples", "2", "--batch-size", "3", "--npd-samples", "0", "--teacher", teacher,
                    "--weights", "fp32")
    assert result.exit_code == 0, result.output
    rows = {row["method"]: row for row in json.loads((out / "results.json").read_text())["rows"]}
    student, timed = rows["ar"], rows["teacher"]
    assert timed["latency_examples"] == student["latency_examples"] == 2 and timed["examples"] == 2
    assert timed["passes_mean"] >= 1 and timed["throughput_batch"] > 0
    # each speedup is the ratio of the two measured times, either way round
    assert student["speedup_teacher_latency"] == pytest.approx(timed["latency_ms_mean"] / student["latency_ms_mean"])
    assert student["speedup_teacher_latency"] * timed["speedup_latency"] == pytest.approx(1.0)
    assert "speedup vs teacher (batch 1)" in (out / "report.md").read_text()


def test_distillation_by_a_teacher_resumes_and_becomes_the_target(task, teacher):
    from accelgen.nar.task import load_task

    arguments = ["nar", "distill", "--task", task, "--teacher", teacher, "--split", "test", "--limit", "2",
                 "--max-new-tokens", "6", "--weights", "fp32"]
    result = invoke(*arguments)
    assert result.exit_code == 0, result.output
    manifest = json.loads((task / "teacher" / "test" / "manifest.json").read_text())
    assert sum(shard["prompts"] for shard in manifest["shards"]) == 2
    records = (task / "teacher" / "test" / "answers-00000.jsonl").read_text()
    assert invoke(*arguments).exit_code == 0  # resumed: nothing left to answer, the answers untouched
    assert (task / "teacher" / "test" / "answers-00000.jsonl").read_text() == records
    loaded = load_task(task)
    assert len(loaded.teacher["test"]) == 2 and "train" not in loaded.teacher
    with pytest.raises(ValueError, match="no teacher summaries of its train split"):
        loaded.pairs("train")


def test_errors_name_the_problem(trained, task, tmp_path):
    folder = trained("ar")
    result = invoke("train", "nar", "--method", "fast-nat", "--task", task, "--out", tmp_path / "x")
    assert result.exit_code == 2 and "unknown NAR method 'fast-nat'" in said(result)
    result = invoke("train", "nar", "--method", "sat", "--task", task, "--out", tmp_path / "x", "--option", "groups=2")
    assert result.exit_code == 2 and "group_size" in said(result)
    result = invoke("nar", "generate", "--model", task, "def f(): pass")
    assert result.exit_code == 2 and "not a model folder" in said(result)
    result = invoke("nar", "generate", "--model", folder, "   ")
    assert result.exit_code == 2 and "empty" in said(result)
    result = invoke("nar", "generate", "--model", folder, "x = 1\n" * 200)
    assert result.exit_code == 2 and "reads at most 96" in said(result)
    result = invoke("nar", "generate", "--model", folder, "-o", "iterations=3", "def f(): pass")
    assert result.exit_code == 2 and "takes max_length" in said(result)
    result = invoke("train", "nar", "--method", "ar", "--task", tmp_path, "--out", tmp_path / "x")
    assert result.exit_code == 2 and "not a code-summary task folder" in said(result)
