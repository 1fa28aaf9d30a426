"""LayerSkip training: the schedules, the loss (= the plain LM loss without dropout and early exits), training
that improves an early exit, and checkpoints that resume to exactly the same weights."""

import os

import pytest
import torch

from accelgen.atomic import CorruptFileError
from accelgen.train.layerskip import (TRAINER_FILE, LayerSkipConfig, exit_accuracy, exit_loss_weights,
                                      layer_dropout_rates, layerskip_loss, packed_windows, train_layerskip)
from accelgen.train.loop import ScaleOut


def test_layer_dropout_rises_from_nothing_to_p_max():
    rates = layer_dropout_rates(5, 0.2)
    assert rates[0] == 0.0 and rates[-1] == pytest.approx(0.2) and rates == sorted(rates)


def test_rotational_curriculum_rotates_and_keeps_the_last_layer():
    config = LayerSkipConfig(rotation=2)
    first, second = exit_loss_weights(6, 0, 10, config), exit_loss_weights(6, 1, 10, config)
    assert sum(first) == pytest.approx(1) and sum(second) == pytest.approx(1)
    assert [w > 0 for w in first] == [False, False, True, False, True, True]  # layer 0 weighs e_scale · 0
    assert [w > 0 for w in second] == [False, True, False, True, False, True]
    assert first[4] > first[2] > first[0] == 0.0  # deeper exits weigh more (layer 0's weight is e_scale · 0)


def test_gradual_curriculum_enables_exits_from_the_top_down():
    config = LayerSkipConfig(curriculum="gradual")
    enabled = [sum(w > 0 for w in exit_loss_weights(5, step, 8, config)) for step in range(8)]
    assert enabled == sorted(enabled) and enabled[0] == 1 and enabled[-1] == 4  # layer 0's weight is 0


def test_windows_are_packed_with_eos_between_texts(tokenizer):
    windows = packed_windows(tokenizer, ["one two three", "four five six seven"] * 10, seq_len=8, count=3)
    assert windows.shape == (3, 8) and tokenizer.eos_token_id in windows.tolist()[0] + windows.tolist()[1]
    with pytest.raises(ValueError, match="fewer than one window"):
        packed_windows(tokenizer, ["hi"], seq_len=64, count=1)


def test_without_dropout_or_early_exits_the_loss_is_the_models_own(make_tiny_model):
    model = make_tiny_model("llama", seed=2, layers=3)
    windows = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    loss, per_layer = layerskip_loss(model, windows, torch.zeros(2, 3, dtype=torch.bool), [0.0, 0.0, 1.0])
    torch.testing.assert_close(loss, model(input_ids=windows, labels=windows).loss)
    assert list(per_layer) == [2]


def test_training_makes_an_early_exit_agree_more_with_the_last_layer(make_tiny_model, tokenizer, tmp_path):
    model = make_tiny_model("qwen2", seed=3, layers=4)
    windows = packed_windows(tokenizer, ["def add(a, b):\n    return a + b\n"] * 40, seq_len=16, count=8)
    before = exit_accuracy(model, windows)[1]["agrees_with_last"]
    config = LayerSkipConfig(steps=30, batch_size=4, seq_len=16, learning_rate=3e-3, rotation=2, checkpoint_every=30)
    train_layerskip(model, tokenizer, windows, config, tmp_path / "out")
    assert exit_accuracy(model, windows)[1]["agrees_with_last"] > before
    assert (tmp_path / "out" / "trainer.pt").exists() and (tmp_path / "out" / "config.json").exists()


def test_a_resumed_run_ends_with_the_same_weights(make_tiny_model, tokenizer, tmp_path):
    windows = packed_windows(tokenizer, ["the cat sat on the mat"] * 40, seq_len=8, count=12)
    settings = dict(batch_size=2, seq_len=8, learning_rate=1e-3, p_max=0.0, checkpoint_every=2)
    straight = make_tiny_model("qwen2", seed=4, layers=2)
    train_layerskip(straight, tokenizer, windows, LayerSkipConfig(steps=6, **settings), tmp_path / "straight")
    interrupted = make_tiny_model("qwen2", seed=4, layers=2)
    train_layerskip(interrupted, tokenizer, windows, LayerSkipConfig(steps=4, **settings), tmp_path / "resumed")
    resumed = make_tiny_model("qwen2", seed=4, layers=2)
    result = train_layerskip(resumed, tokenizer, windows, LayerSkipConfig(steps=6, **settings), tmp_path / "resumed")
    assert result["resumed_at"] == 4
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    with pytest.raises(ValueError, match="other settings"):
        train_layerskip(resumed, tokenizer, windows, LayerSkipConfig(steps=6, **{**settings, "p_max": 0.2}),
                        tmp_path / "resumed")


def test_gradient_accumulation_ends_with_the_weights_of_whole_batches(make_tiny_model, tokenizer, tmp_path):
    windows = torch.randint(0, 256, (12, 8), generator=torch.Generator().manual_seed(0))
    config = LayerSkipConfig(steps=2, batch_size=5, seq_len=8, learning_rate=1e-3, p_max=0.5, rotation=2)
    trained = []
    for scale in (None, ScaleOut(grad_accum=2)):  # 5 rows: micro-batches of 2 and 3, each with its rows' dropout
        model = make_tiny_model("qwen2", seed=4, layers=3, vocab_size=256)
        train_layerskip(model, tokenizer, windows, config, tmp_path / str(scale), scale=scale)
        trained.append(model.state_dict())
    for name, whole in trained[0].items():
        # summing the gradient in parts rounds differently, which Adam turns into moves of up to ~2% of the learning
        # rate where a gradient is near zero (k_proj's bias: softmax ignores it); other dropout moves them by ~4e-3
        torch.testing.assert_close(trained[1][name], whole, rtol=0, atol=1e-4, msg=name)


def test_a_crafted_checkpoint_runs_no_code(make_tiny_model, tmp_path):
    class Payload:  # what unpickling it would run
        def __reduce__(self):
            return os.mkdir, (str(tmp_path / "code ran"),)

    out = tmp_path / "out"
    out.mkdir()
    torch.save({"step": 2, "config": {}, "optimizer": Payload()}, out / TRAINER_FILE)
    windows = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(CorruptFileError, match="trainer.pt is unreadable .*delete it and rerun the same command"):
        train_layerskip(make_tiny_model("qwen2", seed=4), None, windows, LayerSkipConfig(steps=2, seq_len=8), out)
    assert not (tmp_path / "code ran").exists()


def test_the_command_trains_reports_and_plots(command_inputs, tmp_path):
    import json

    from typer.testing import CliRunner

    from accelgen.cli import app

    folder, dataset = command_inputs(5, layers=2)
    out = tmp_path / "trained"
    result = CliRunner().invoke(app, ["train", "layerskip", "--model", str(folder), "--dataset", dataset,
                                      "--out", str(out), "--steps", "3", "--batch-size", "2", "--seq-len", "8",
                                      "--held-out", "2", "--checkpoint-every", "2"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "exit_accuracy.json").read_text())
    assert len(report["exit_accuracy_before"]) == len(report["exit_accuracy_after"]) == 2
    assert (out / "exit_accuracy.png").read_bytes()[:4] == b"\x89PNG" and (out / "model.safetensors").exists()
    failed = CliRunner().invoke(app, ["train", "layerskip", "--model", str(folder), "--out", str(out),
                                      "--curriculum", "sideways"])
    assert failed.exit_code == 2 and "curriculum must be one of rotational, gradual" in failed.output
