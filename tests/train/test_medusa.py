"""Medusa heads: targets at the right offsets, untrained = the target's own next-token guess, training that
learns, held-out accuracy, saving, refusal for another model, and the command."""

import json

import pytest
import torch
from typer.testing import CliRunner

from accelgen.cli import app
from accelgen.train.layerskip import packed_windows
from accelgen.train.medusa import MedusaHeads, evaluate_medusa, final_hidden_states, head_targets, train_medusa


def test_head_k_is_taught_the_token_k_plus_one_places_on():
    windows = torch.arange(12).view(2, 6)
    positions, targets = head_targets(windows, heads=2)
    assert positions.tolist()[:3] == [[0, 0], [0, 1], [0, 2]] and len(positions) == 6
    assert targets.tolist()[:3] == [[2, 3], [3, 4], [4, 5]]  # from position t: t + 2 and t + 3
    assert targets.tolist()[3] == [8, 9]
    with pytest.raises(ValueError, match="too short for 5 heads"):
        head_targets(windows, heads=5)


def test_untrained_heads_repeat_the_targets_next_token_guess(make_tiny_model):
    model = make_tiny_model("qwen2", seed=2)
    hidden = torch.randn(3, 64)
    logits = MedusaHeads(2, 64)(hidden, model.lm_head)
    expected = model.lm_head(hidden).float()
    torch.testing.assert_close(logits[0], expected) and torch.testing.assert_close(logits[1], expected)


@pytest.fixture(scope="module")
def trained(make_tiny_model, tokenizer):
    model = make_tiny_model("qwen2", seed=3)
    windows = packed_windows(tokenizer, ["one two three four five six seven eight nine ten"] * 30, seq_len=16, count=10)
    hidden = final_hidden_states(model, windows)
    return model, windows, hidden, train_medusa(model, windows, hidden, 2, steps=80, batch_size=64, learning_rate=1e-2)


def test_training_learns_a_repetitive_text(trained):
    model, windows, hidden, heads = trained
    untrained = evaluate_medusa(model, MedusaHeads(2, 64), windows, hidden)
    learned = evaluate_medusa(model, heads, windows, hidden)
    assert all(after["top1"] > before["top1"] for after, before in zip(learned, untrained))
    assert all(row["top5"] >= row["top1"] for row in learned) and [row["offset"] for row in learned] == [2, 3]
    assert all(parameter.requires_grad for parameter in model.parameters())  # the LM head is given back


def test_saved_heads_load_only_onto_a_model_they_fit(trained, make_tiny_model, tmp_path):
    model, _, hidden, heads = trained
    heads.save(tmp_path / "heads")
    loaded = MedusaHeads.load(tmp_path / "heads", model)
    torch.testing.assert_close(loaded(hidden[0, :3], model.lm_head), heads(hidden[0, :3], model.lm_head))
    with pytest.raises(ValueError, match="do not fit this model: vocabulary 49152, the model's is 8"):
        MedusaHeads.load(tmp_path / "heads", make_tiny_model("qwen2", seed=3, vocab_size=8))
    with pytest.raises(FileNotFoundError, match="accelgen train medusa"):
        MedusaHeads.load(tmp_path / "nothing")


def test_the_command_trains_evaluates_and_saves(command_inputs, tmp_path):
    folder, dataset = command_inputs(4)
    out = tmp_path / "heads"
    result = CliRunner().invoke(app, ["train", "medusa", "--model", str(folder), "--dataset", dataset,
                                      "--out", str(out), "--heads", "3", "--windows", "6", "--held-out", "2",
                                      "--seq-len", "12", "--steps", "5", "--batch-size", "16"])
    assert result.exit_code == 0, result.output
    assert [row["head"] for row in json.loads((out / "evaluation.json").read_text())["heads"]] == [1, 2, 3]
    assert len(MedusaHeads.load(out)) == 3
