"""The shared trainer: every method lowers its held-out loss in a few steps; a run resumed from its checkpoint ends
with exactly the weights of an unbroken run (random masks and dropout included); a checkpoint of other settings is
refused."""

from __future__ import annotations

import pytest
import torch

from accelgen.nar.ar import ARStudent
from accelgen.nar.mask_predict import CMLMModel
from accelgen.nar.nat import NATModel
from accelgen.nar.sat import SATModel
from accelgen.nar.train import TrainSettings, held_out_loss, train_model

METHODS = [(ARStudent, {}), (NATModel, {}), (NATModel, {"decoder_inputs": "uniform"}), (CMLMModel, {}),
           (SATModel, {"group_size": 2})]


@pytest.mark.parametrize("cls, options", METHODS, ids=["ar", "nat-fertility", "nat-uniform", "cmlm", "sat"])
def test_training_lowers_the_held_out_loss(cls, options, seeded, tiny_config, copy_task):
    _, rows, held_out, _ = copy_task
    model = seeded(cls, tiny_config(dropout=0.1), **options)
    shown = []
    result = train_model(model, rows, TrainSettings(steps=30, batch_size=32, learning_rate=3e-3, eval_every=15),
                         held_out=held_out, progress=shown.append)
    steps, losses = zip(*result["held_out"])
    assert steps == (0, 15, 30)
    assert losses[2] < 0.6 * losses[0], losses
    assert [row["step"] for row in shown] == list(range(1, 31)) and not model.training


def test_the_held_out_loss_is_the_same_measured_twice_and_keeps_the_mode(seeded, tiny_config, copy_task):
    model = seeded(CMLMModel, tiny_config(dropout=0.3)).train()
    held_out = copy_task[2]
    first = held_out_loss(model, held_out, batch_size=20)
    assert held_out_loss(model, held_out, batch_size=20) == first and model.training
    assert held_out_loss(model, held_out, batch_size=20, seed=1) != first  # other masks: the seed decides them


def test_a_resumed_run_ends_with_the_weights_of_an_unbroken_one(seeded, tiny_config, copy_task, tmp_path):
    rows = copy_task[1]
    config = tiny_config(dropout=0.1)  # dropout and CMLM's masks: random draws that must repeat
    settings = TrainSettings(steps=6, batch_size=16, learning_rate=3e-3, checkpoint_every=3)
    unbroken = seeded(CMLMModel, config)
    train_model(unbroken, rows, settings)

    checkpoint = tmp_path / "checkpoint.pt"
    first_half = seeded(CMLMModel, config)
    train_model(first_half, rows, TrainSettings(**{**settings.__dict__, "steps": 3}), checkpoint=checkpoint)
    resumed = seeded(CMLMModel, config)
    assert train_model(resumed, rows, settings, checkpoint=checkpoint)["resumed_at"] == 3
    for name, tensor in unbroken.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
    assert not torch.equal(first_half.backbone.embed.weight, resumed.backbone.embed.weight)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint.pt"]  # written whole: no leftovers

    with pytest.raises(ValueError, match="trained with other settings"):
        train_model(seeded(CMLMModel, config), rows, TrainSettings(**{**settings.__dict__, "learning_rate": 1e-3}),
                    checkpoint=checkpoint)
    with pytest.raises(ValueError, match="trained with other settings"):
        train_model(seeded(SATModel, config), rows, settings, checkpoint=checkpoint)
