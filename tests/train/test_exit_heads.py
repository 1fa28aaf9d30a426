"""Exit heads: untrained = the plain exit, training sharpens it, saved heads load only onto a model they fit,
CALM's classifier measure uses them, and the command trains, evaluates and saves."""

import json

import pytest
import torch
from typer.testing import CliRunner

import accelgen
from accelgen.cli import app
from accelgen.heads.exit_heads import ExitHeads
from accelgen.train.exit_heads import collect_hidden_states, evaluate_exit_heads, train_exit_heads
from accelgen.train.layerskip import packed_windows
from accelgen.train.loop import ScaleOut

PROMPT = [5, 17, 923, 4410, 77, 12]


@pytest.fixture(scope="module")
def four_layers(make_tiny_model):
    return make_tiny_model("qwen2", seed=6, layers=4)


@pytest.fixture(scope="module")
def trained(four_layers, tokenizer):
    windows = packed_windows(tokenizer, ["def add(a, b):\n    return a + b\n# sum of two numbers\n"] * 60,
                             seq_len=16, count=12)
    hidden = collect_hidden_states(four_layers, windows, [1, 2])
    heads = train_exit_heads(four_layers, hidden, [1, 2], rank=16, steps=60, batch_size=64, learning_rate=1e-2)
    return heads, hidden


def test_training_makes_the_adapted_exit_agree_more(four_layers, trained):
    heads, hidden = trained
    assert all(parameter.requires_grad for parameter in four_layers.parameters())  # the base is given back as it was
    for row in evaluate_exit_heads(four_layers, heads, hidden):
        assert row["adapted_agreement"] > row["plain_agreement"] and row["classifier_accuracy"] > 0.5


def test_micro_batches_train_the_heads_the_whole_batch_does(four_layers, trained):
    _, hidden = trained
    whole, accumulated = (train_exit_heads(four_layers, hidden, [1, 2], rank=16, steps=2, batch_size=64,
                                           learning_rate=1e-2, scale=scale).state_dict()
                          for scale in (ScaleOut(), ScaleOut(grad_accum=2)))
    for name, value in whole.items():
        # AdamW moves an entry by lr·g/(|g| + 1e-8): where g is near 1e-8, the rounding of summing it in parts
        # shows, up to ~1e-3 of lr (1e-2)
        torch.testing.assert_close(accumulated[name], value, rtol=0, atol=5e-5)


def test_saved_heads_load_onto_a_model_they_fit_and_no_other(four_layers, make_tiny_model, trained, tmp_path):
    heads, hidden = trained
    heads.save(tmp_path / "heads")
    loaded = ExitHeads.load(tmp_path / "heads", four_layers)
    state = hidden[1][:5]
    torch.testing.assert_close(loaded.adapt(1, state), heads.adapt(1, state))
    with pytest.raises(ValueError, match="do not fit this model: layer count 4, the model.s is 2"):
        ExitHeads.load(tmp_path / "heads", make_tiny_model("qwen2", seed=6, layers=2))
    with pytest.raises(FileNotFoundError, match="accelgen train exit-heads"):
        ExitHeads.load(tmp_path / "nothing", four_layers)


def test_calm_with_the_classifier_measure(four_layers, tokenizer, trained, tmp_path):
    heads, _ = trained
    heads.save(tmp_path / "heads")
    options = dict(method="calm", max_new_tokens=8, measure="classifier", heads=str(tmp_path / "heads"))
    full = accelgen.generate(four_layers, tokenizer, PROMPT, max_new_tokens=8)
    never = accelgen.generate(four_layers, tokenizer, PROMPT, threshold=1.0, **options)
    assert never.token_ids == full.token_ids and never.stats["mean_layers"] == 4
    always = accelgen.generate(four_layers, tokenizer, PROMPT, threshold=0.0, **options)
    assert always.stats["mean_layers"] == 2  # heads at layers 1 and 2: the first one
    with pytest.raises(ValueError, match="needs trained exit heads"):
        accelgen.generate(four_layers, tokenizer, PROMPT, method="calm", measure="classifier")
    with pytest.raises(ValueError, match="no classifier for layers \\[0\\]"):
        accelgen.generate(four_layers, tokenizer, PROMPT, exit_layers=[0], **options)


def test_the_command_trains_evaluates_and_saves(command_inputs, tmp_path):
    folder, dataset = command_inputs(7, layers=4)
    out = tmp_path / "heads"
    result = CliRunner().invoke(app, ["train", "exit-heads", "--model", str(folder), "--dataset", dataset,
                                      "--out", str(out), "--layers", "1,2", "--windows", "6", "--held-out", "2",
                                      "--seq-len", "8", "--steps", "5", "--batch-size", "16", "--rank", "8"])
    assert result.exit_code == 0, result.output
    assert [row["layer"] for row in json.loads((out / "evaluation.json").read_text())["layers"]] == [1, 2]
    assert ExitHeads.load(out).layers == [1, 2]
    last = CliRunner().invoke(app, ["train", "exit-heads", "--model", str(folder), "--dataset", dataset,
                                    "--out", str(out), "--layers", "3", "--windows", "6", "--held-out", "2",
                                    "--seq-len", "8"])
    assert last.exit_code == 2 and "needs no exit head" in last.output
