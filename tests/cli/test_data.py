"""`accelgen data regenerate`: answers in resumable shards, refused under other settings, and a dataset the
trainers read (`--dataset regenerated:DIR`), whose features go to a sharded store in the format chosen for them."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from accelgen.cli import app
from accelgen.datasets.regenerated import MANIFEST, regenerated_records


@pytest.fixture
def inputs(make_tiny_model, tokenizer, tmp_path):
    """(model folder, "jsonl:FILE" of 5 chat prompts)."""
    folder, prompts = tmp_path / "tiny", tmp_path / "prompts.jsonl"
    make_tiny_model("qwen2", seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "turns": [f"Question {i}: what is {i} plus {i}?"]}) + "\n"
                               for i in range(5)))
    return folder, f"jsonl:{prompts}"


def regenerate(folder, dataset, out, *extra):
    return CliRunner().invoke(app, ["data", "regenerate", "--model", str(folder), "--dataset", dataset, "--out",
                                    str(out), "-n", "5", "--shard-prompts", "2", "--batch-size", "2", "--threads", "1",
                                    "--weights", "fp32", *extra])


def test_regenerate_resumes_and_refuses_other_settings(inputs, tmp_path):
    folder, dataset = inputs
    out = tmp_path / "answers"
    first = regenerate(folder, dataset, out)
    assert first.exit_code == 0, first.output
    assert "answered 5 of 5 prompts" in first.output and "tokens/s" in first.output
    manifest = json.loads((out / MANIFEST).read_text())
    assert [entry["prompts"] for entry in manifest["shards"]] == [2, 2, 1]
    assert [record["id"] for record in regenerated_records(out)] == [f"q{i}" for i in range(5)]
    again = regenerate(folder, dataset, out)
    assert again.exit_code == 0 and "(5 answered before)" in again.output, again.output
    other = regenerate(folder, dataset, out, "--temperature", "0.5")
    printed = " ".join(other.output.split())
    assert other.exit_code == 2 and "other settings (temperature: 0.0 there vs 0.5 now)" in printed, other.output


def test_a_trainer_trains_on_regenerated_data(inputs, tmp_path):
    folder, dataset = inputs
    answers = tmp_path / "answers"
    assert regenerate(folder, dataset, answers).exit_code == 0
    result = CliRunner().invoke(app, ["train", "eagle", "--model", str(folder), "--dataset", f"regenerated:{answers}",
                                      "--out", str(tmp_path / "eagle"), "--windows", "3", "--held-out", "1",
                                      "--seq-len", "16", "--steps", "2", "--draft-vocab", "0", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "eagle" / "evaluation.json").read_text())["held_out_windows"] == 1


def test_features_go_to_a_sharded_store_in_the_chosen_format(inputs, tmp_path, capsys):
    from accelgen.cli.train.common import FeaturesRun, windows_and_features
    from accelgen.train.eagle import collect_features

    folder, dataset = inputs
    answers = tmp_path / "answers"
    assert regenerate(folder, dataset, answers).exit_code == 0

    def run(**changes):
        return FeaturesRun(**{"model": str(folder), "dataset": f"regenerated:{answers}", "out": tmp_path / "eagle",
                              "windows": 3, "held_out": 1, "seq_len": 16, "threads": 1, **changes})

    first = windows_and_features(run(extract_format="fp32"))
    assert "features extracted in fp32: --extract-format" in capsys.readouterr().err
    assert first.target_model.dtype == torch.float32 and first.tokenizer is not None
    features, choices = collect_features(first.target_model, first.windows)
    assert torch.equal(first.features, features) and torch.equal(first.choices, choices)
    index = json.loads((tmp_path / "eagle" / "features" / "last-hidden" / "index.json").read_text())
    assert index["identity"]["format"] == "fp32" and index["shards"][-1]["end"] == 4

    again = windows_and_features(run())  # auto keeps the format of the store it resumes
    assert "in fp32: the format of the feature store being resumed" in capsys.readouterr().err
    assert torch.equal(again.features, first.features)
    with pytest.raises(ValueError, match="another run \\(format: 'fp32' stored vs 'bf16' this run\\)"):
        windows_and_features(run(extract_format="bf16"))
    with pytest.raises(ValueError, match="--extract-format fp16"):
        run(extract_format="fp16")

    layered = windows_and_features(run(extract_format="fp32"), layers_for=lambda target: (0, 1))  # EAGLE-3's kind
    assert layered.features.shape == (4, 16, 2 * first.features.shape[-1])
    assert torch.equal(layered.choices, first.choices)
    assert json.loads((tmp_path / "eagle" / "features" / "layer-states" / "index.json").read_text())[
        "identity"]["layers"] == [0, 1]


def test_a_folder_without_answers_is_named(inputs, tmp_path):
    folder, _ = inputs
    result = CliRunner().invoke(app, ["train", "eagle", "--model", str(folder), "--dataset", f"regenerated:{tmp_path}",
                                      "--out", str(tmp_path / "eagle"), "--steps", "1", "--extract-format", "fp32"])
    assert result.exit_code == 2 and "no regenerated data" in result.output, result.output
