"""Training MPEE heads: weighted self-distillation sharpens the exits, a resumed run ends where an uninterrupted one
does, the held-out evaluation's ends are fixed (threshold 1: the full model; 0: the first exit), and the command
trains, saves and resumes."""

import json

import pytest
import torch
from typer.testing import CliRunner

from accelgen.cli import app
from accelgen.heads.mpee import MpeeHeads
from accelgen.train.exit_heads import collect_hidden_states
from accelgen.train.loop import ScaleOut
from accelgen.train.mpee import CHECKPOINT, MpeeConfig, distillation_weights, evaluate_mpee, step_rows, train_mpee

pytestmark = pytest.mark.usefixtures("one_thread")
EXITS = [0, 1, 2]


@pytest.fixture(scope="module")
def four_layers(make_tiny_model):
    """A tiny 4-layer model with peaked next-token distributions, as a trained LM's are (random ones are flat)."""
    model = make_tiny_model("qwen2", seed=0, layers=4, vocab_size=1024)
    with torch.no_grad():
        model.lm_head.weight.mul_(3)
    return model


@pytest.fixture(scope="module")
def hidden_states(four_layers):
    """{layer: (positions, d)} of the tiny 4-layer model over token windows (the exits' and the last layer's)."""
    windows = torch.randint(0, 1024, (6, 24), generator=torch.Generator().manual_seed(0))
    return collect_hidden_states(four_layers, windows, EXITS)


def test_deeper_exits_weigh_more_and_the_weights_average_one():
    assert distillation_weights(1) == [1.0]
    assert distillation_weights(3) == pytest.approx([0.5, 1.0, 1.5])


def test_each_step_draws_its_own_positions():
    assert torch.equal(step_rows(4, 100, 8, seed=0), step_rows(4, 100, 8, seed=0))
    assert not torch.equal(step_rows(4, 100, 8, seed=0), step_rows(5, 100, 8, seed=0))
    assert step_rows(0, 5, 8, seed=0).shape == (5,)


def test_distillation_brings_the_exits_toward_the_last_layer(four_layers, hidden_states):
    heads, times = train_mpee(four_layers, hidden_states, EXITS, MpeeConfig(rank=16, steps=40, batch_size=64,
                                                                            learning_rate=1e-2))
    assert times["resumed_at"] == 0 and all(p.requires_grad for p in four_layers.parameters())  # base unfrozen after
    evaluation = evaluate_mpee(four_layers, heads, hidden_states)
    exits = {row["layer"]: row for row in evaluation["exits"]}
    for layer in EXITS:  # on the positions trained on, each trained exit beats the plain one
        assert exits[layer]["trained_agreement"] > exits[layer]["plain_agreement"] + 0.1


def test_a_resumed_run_ends_with_the_same_heads(four_layers, hidden_states, tmp_path):
    config = MpeeConfig(rank=8, steps=6, batch_size=16, checkpoint_every=3)
    straight, _ = train_mpee(four_layers, hidden_states, EXITS, config)
    first, _ = train_mpee(four_layers, hidden_states, EXITS, MpeeConfig(rank=8, steps=3, batch_size=16,
                                                                        checkpoint_every=3), out_dir=tmp_path)
    resumed, times = train_mpee(four_layers, hidden_states, EXITS, config, out_dir=tmp_path)
    assert times["resumed_at"] == 3 and (tmp_path / CHECKPOINT).exists()
    for name, value in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=0, atol=0)
    assert not torch.equal(first.state_dict()["adapters.2.weight"], straight.state_dict()["adapters.2.weight"])
    with pytest.raises(ValueError, match="trained with other settings"):
        train_mpee(four_layers, hidden_states, EXITS, MpeeConfig(rank=4, steps=6), out_dir=tmp_path)


def test_micro_batches_train_the_heads_the_whole_batch_does(four_layers, hidden_states):
    config = MpeeConfig(rank=8, steps=3, batch_size=16)
    whole, _ = train_mpee(four_layers, hidden_states, EXITS, config)
    accumulated, _ = train_mpee(four_layers, hidden_states, EXITS, config, scale=ScaleOut(grad_accum=2))
    for name, value in whole.state_dict().items():  # the rounding of summing in parts, through 3 AdamW steps of lr 1e-3
        torch.testing.assert_close(accumulated.state_dict()[name], value, rtol=0, atol=1e-7)


def test_the_evaluation_ends_are_the_full_model_and_the_first_exit(four_layers, hidden_states):
    heads = MpeeHeads.for_model(four_layers, EXITS, rank=8)
    evaluation = evaluate_mpee(four_layers, heads, hidden_states, chunk=50, thresholds=(1.0, 0.0))
    full, first = evaluation["thresholds"]
    assert full == {"threshold": 1.0, "mean_layers": 4.0, "agreement": 1.0}
    plain_first = evaluation["exits"][0]["plain_agreement"]  # untrained: the trained exit is the plain one
    assert first["mean_layers"] == 1.0 and first["agreement"] == pytest.approx(plain_first)
    assert evaluation["positions"] == hidden_states[3].shape[0]


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="must be positive"):
        MpeeConfig(steps=0)


def test_the_command_trains_saves_and_resumes(command_inputs, tmp_path):
    folder, dataset = command_inputs(seed=0, layers=4)
    out = tmp_path / "heads"
    arguments = ["train", "mpee", "--model", str(folder), "--dataset", dataset, "--out", str(out), "--windows", "4",
                 "--held-out", "2", "--seq-len", "16", "--steps", "4", "--batch-size", "16", "--rank", "8",
                 "--layers", "0,2", "--checkpoint-every", "2", "--threads", "1"]
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 0, result.output
    assert "trained exit agrees" in result.output and "mean layers" in result.output
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert [row["layer"] for row in evaluation["exits"]] == [0, 2] and evaluation["resumed_at"] == 0
    assert MpeeHeads.load(out).layers == [0, 2]
    again = CliRunner().invoke(app, arguments)  # the checkpoint is at the last step: nothing left to train
    assert again.exit_code == 0 and json.loads((out / "evaluation.json").read_text())["resumed_at"] == 4
    last = CliRunner().invoke(app, arguments[:-6] + ["--layers", "0,3", "--threads", "1"])
    assert last.exit_code != 0 and "layer 3 is the last layer" in last.output and "Traceback" not in last.output
