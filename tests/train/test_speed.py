"""Training a shared-cycle model for SPEED: it learns, resumes exactly, reports held-out metrics and saves a folder
that loads with its layers shared."""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from accelgen.models import shared_cycle
from accelgen.train.loop import ScaleOut
from accelgen.train.speed import (
    SpeedModelConfig,
    held_out_metrics,
    learning_rate,
    new_model,
    train_speed_model,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(batch_size=2, seq_len=16, cycle=2, repeats=2, hidden_size=32, intermediate_size=64, heads=4,
            learning_rate=3e-3, warmup=2)


@pytest.fixture(scope="module")
def windows():
    """(12, 16) windows of a repeating pattern a small model learns quickly."""
    pattern = torch.tensor([3, 9, 27, 81, 50, 11, 33, 99] * 30)
    return pattern[: 12 * 16].view(12, 16)


def test_training_lowers_the_loss_and_the_exit_learns_too(windows, tmp_path):
    config = SpeedModelConfig(steps=24, checkpoint_every=100, **TINY)
    model = new_model(128, config)
    before = held_out_metrics(model, windows[:2])
    train_speed_model(model, windows[2:], config, tmp_path)
    after = held_out_metrics(model, windows[:2])
    assert after["loss"] < before["loss"] - 1 and after["exit_loss"] < before["exit_loss"] - 1
    assert after["perplexity"] == pytest.approx(math.exp(after["loss"]))
    assert 0 <= after["exit_agrees_with_last"] <= 1 and after["positions"] == 2 * 15
    assert shared_cycle.cycle_and_repeats(model, "test") == (2, 2)  # training kept the sharing


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(windows, tmp_path):
    config = SpeedModelConfig(steps=6, checkpoint_every=3, **TINY)
    whole = new_model(128, config)
    train_speed_model(whole, windows, config, tmp_path / "whole")
    first_half = new_model(128, config)
    train_speed_model(first_half, windows, SpeedModelConfig(steps=3, checkpoint_every=3, **TINY), tmp_path / "halves")
    resumed = new_model(128, config)
    result = train_speed_model(resumed, windows, config, tmp_path / "halves")
    assert result["resumed_at"] == 3
    for (name, expected), (_, got) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(expected, got), name
    assert shared_cycle.cycle_and_repeats(resumed, "test") == (2, 2)


def test_gradient_accumulation_ends_with_the_weights_of_whole_batches(windows, tmp_path):
    config = SpeedModelConfig(steps=4, checkpoint_every=100, **{**TINY, "batch_size": 5})
    whole = new_model(128, config)
    train_speed_model(whole, windows, config, tmp_path / "whole")
    for micro in (2, 3):  # 5 rows in micro-batches of 2 and 3, or of 1, 2 and 2
        accumulated = new_model(128, config)
        train_speed_model(accumulated, windows, config, tmp_path / str(micro), scale=ScaleOut(grad_accum=micro))
        for (name, expected), got in zip(whole.state_dict().items(), accumulated.state_dict().values()):
            # summing the gradient in parts rounds differently, which moves weights by ~1e-6 (Adam); other batches
            # move them by ~1e-2
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=name)


def test_a_checkpoint_of_other_settings_is_refused(windows, tmp_path):
    config = SpeedModelConfig(steps=2, checkpoint_every=1, **TINY)
    train_speed_model(new_model(128, config), windows, config, tmp_path)
    other = SpeedModelConfig(steps=2, checkpoint_every=1, **{**TINY, "learning_rate": 1e-3})
    with pytest.raises(ValueError, match="trained with other settings"):
        train_speed_model(new_model(128, other), windows, other, tmp_path)


def test_the_schedule_warms_up_then_decays_to_a_tenth():
    config = SpeedModelConfig(steps=100, warmup=10, learning_rate=1.0)
    assert learning_rate(0, config) == pytest.approx(0.1) and learning_rate(9, config) == pytest.approx(1.0)
    assert learning_rate(10, config) == pytest.approx(1.0) and learning_rate(100, config) == pytest.approx(0.1)


@pytest.mark.parametrize("bad, message", [({"repeats": 1}, "repeats must be >= 2"), ({"steps": 0}, "must be positive"),
                                          ({"hidden_size": 30}, "not a multiple of heads"),
                                          ({"exit_weight": -1.0}, "exit_weight")])
def test_bad_settings_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SpeedModelConfig(**bad)


def test_the_command_trains_saves_and_reports(tmp_path, tokenizer):
    from accelgen.cli import app

    tokenizer.save_pretrained(tmp_path / "tokenizer")
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"line {i}: the quick brown fox jumps"}) + "\n" for i in range(40)))
    out = tmp_path / "model"
    result = CliRunner().invoke(app, ["train", "speed-model", "--tokenizer", str(tmp_path / "tokenizer"),
                                      "--dataset", f"jsonl:{texts}", "--out", str(out), "--steps", "2",
                                      "--batch-size", "2", "--seq-len", "16", "--hidden-size", "32",
                                      "--intermediate-size", "64", "--cycle", "2", "--repeats", "2",
                                      "--held-out", "2", "--threads", "1"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "speed_model.json").read_text())
    assert report["config"]["cycle"] == 2 and report["held_out"]["perplexity"] > 1
    model, _ = shared_cycle.load(out)
    assert shared_cycle.cycle_and_repeats(model, "test") == (2, 2)
    assert model.config.vocab_size == len(tokenizer)
