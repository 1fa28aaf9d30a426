"""Medusa heads: targets at the right offsets, untrained = the target's own next-token guess, training that
learns, checkpoints that resume, held-out accuracy, saving, refusal for another model, and the command."""

import json

import pytest
import torch
from typer.testing import CliRunner

from accelgen.atomic import CorruptFileError
from accelgen.cli import app
from accelgen.heads.lm_head import draft_vocabulary
from accelgen.heads.medusa import MedusaHeads
from accelgen.train import medusa as medusa_training
from accelgen.train.eagle import collect_features
from accelgen.train.layerskip import packed_windows
from accelgen.train.medusa import MedusaConfig, evaluate_medusa, head_targets, train_medusa

SMALL = dict(heads=2, batch_size=64, learning_rate=1e-2, draft_vocab=0)


def test_head_k_is_taught_the_targets_choice_k_places_on():
    choices = torch.arange(12).view(2, 6)  # choices[t]: the target's token after position t
    positions, targets = head_targets(choices, heads=2)
    assert positions.tolist()[:3] == [[0, 0], [0, 1], [0, 2]] and len(positions) == 8
    assert targets.tolist()[:3] == [[1, 2], [2, 3], [3, 4]]  # from position t: the tokens at t + 2 and t + 3
    assert targets.tolist()[4] == [7, 8]
    with pytest.raises(ValueError, match="too short for 6 heads"):
        head_targets(choices, heads=6)


@pytest.fixture(scope="module")
def trained(make_tiny_model, tokenizer):
    model = make_tiny_model("qwen2", seed=3)
    windows = packed_windows(tokenizer, ["one two three four five six seven eight nine ten"] * 30, seq_len=16, count=10)
    features, choices = collect_features(model, windows)
    heads, _ = train_medusa(model, windows, features, choices, MedusaConfig(steps=80, **SMALL))
    return model, windows, features, choices, heads


def test_training_learns_the_targets_choices(trained):
    model, _, features, choices, heads = trained
    untrained = evaluate_medusa(model, MedusaHeads(2, 64), features, choices)
    learned = evaluate_medusa(model, heads, features, choices)
    assert all(after["top1"] > before["top1"] + 0.2 for after, before in zip(learned, untrained)), (untrained, learned)
    assert all(row["top5"] >= row["top1"] for row in learned) and [row["offset"] for row in learned] == [2, 3]
    assert all(parameter.requires_grad for parameter in model.parameters())  # the target is untouched


def test_heads_with_a_draft_vocabulary_draft_only_from_it(trained):
    model, windows, features, choices, _ = trained
    heads, _ = train_medusa(model, windows, features, choices, MedusaConfig(steps=3, **{**SMALL, "draft_vocab": 40}))
    assert torch.equal(heads.vocab, draft_vocabulary(windows, choices, model.config.vocab_size, 40))
    logits = heads.lm_head(model)(heads(features[0, :4]))  # (2, 4, vocab)
    outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
    outside[heads.vocab] = False
    assert torch.isinf(logits[..., outside]).all() and torch.isfinite(logits[..., heads.vocab]).all()


def test_checkpoints_resume(trained, tmp_path):
    model, windows, features, choices, _ = trained
    _, first = train_medusa(model, windows, features, choices, MedusaConfig(steps=4, checkpoint_every=2, **SMALL), tmp_path)
    _, second = train_medusa(model, windows, features, choices, MedusaConfig(steps=6, checkpoint_every=2, **SMALL), tmp_path)
    assert (first["resumed_at"], second["resumed_at"]) == (0, 4)
    assert torch.load(tmp_path / medusa_training.CHECKPOINT, weights_only=True)["step"] == 6
    with pytest.raises(ValueError, match="other settings"):
        train_medusa(model, windows, features, choices, MedusaConfig(steps=8, **{**SMALL, "heads": 3}), tmp_path)


def test_saved_heads_load_only_onto_a_model_they_fit(trained, make_tiny_model, tmp_path):
    model, _, features, _, heads = trained
    heads.save(tmp_path / "heads")
    loaded = MedusaHeads.load(tmp_path / "heads", model)
    torch.testing.assert_close(loaded(features[0, :3]), heads(features[0, :3]))
    with pytest.raises(ValueError, match="do not fit this model: vocabulary 49152, the model's is 8"):
        MedusaHeads.load(tmp_path / "heads", make_tiny_model("qwen2", seed=3, vocab_size=8))
    with pytest.raises(FileNotFoundError, match="accelgen train medusa"):
        MedusaHeads.load(tmp_path / "nothing")


def test_damaged_heads_are_named_with_the_command_that_trains_them(trained, tmp_path):
    heads = trained[-1]
    heads.save(tmp_path)
    weights = tmp_path / "medusa_heads.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CorruptFileError, match="medusa_heads.safetensors is unreadable .*`accelgen train medusa --out"):
        MedusaHeads.load(tmp_path)


def test_a_damaged_checkpoint_is_named_not_aborted(command_inputs, tmp_path):
    folder, dataset = command_inputs(4)
    checkpoint = tmp_path / "heads" / medusa_training.CHECKPOINT
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"")  # what a kill during an in-place write left
    result = CliRunner().invoke(app, ["train", "medusa", "--model", str(folder), "--dataset", dataset, "--num-heads", "2",
                                      "--windows", "4", "--held-out", "1", "--seq-len", "12", "--steps", "2",
                                      "--batch-size", "16", "--draft-vocab", "0", "--out", str(checkpoint.parent)])
    printed = "".join(result.output.split())  # without the console's line breaks
    assert result.exit_code == 2 and "Aborted" not in result.output, result.output
    assert f"{checkpoint}isunreadable" in printed and "deleteitandrerunthesamecommand" in printed, result.output


def test_the_command_trains_evaluates_saves_and_shares_a_feature_cache(command_inputs, tmp_path):
    folder, dataset = command_inputs(4)
    arguments = ["train", "medusa", "--model", str(folder), "--dataset", dataset, "--num-heads", "3", "--windows", "6",
                 "--held-out", "2", "--seq-len", "12", "--steps", "5", "--batch-size", "16", "--draft-vocab", "300"]
    result = CliRunner().invoke(app, [*arguments, "--out", str(tmp_path / "heads")])
    assert result.exit_code == 0, result.output
    evaluation = json.loads((tmp_path / "heads" / "evaluation.json").read_text())
    assert [row["head"] for row in evaluation["heads"]] == [1, 2, 3] and evaluation["config"]["draft_vocab"] == 300
    assert len(MedusaHeads.load(tmp_path / "heads")) == 3 and (tmp_path / "heads" / "features" / "last-hidden").is_dir()
    shared = CliRunner().invoke(app, [*arguments, "--out", str(tmp_path / "more"), "--features", str(tmp_path / "heads")])
    assert shared.exit_code == 0, shared.output
    assert not (tmp_path / "more" / "features").exists() and (tmp_path / "more" / "medusa_heads.json").exists()


def test_eval_every_records_a_learning_curve_that_resumes(command_inputs, tmp_path):
    """--eval-every: held-out top-1 per head and measured tau at steps 0, 2, 4, against positions trained on; a
    resumed run keeps the points before it and adds its own."""
    from accelgen.train.curves import CURVE_JSON

    folder, dataset = command_inputs(4)
    arguments = ["train", "medusa", "--model", str(folder), "--dataset", dataset, "--num-heads", "3", "--windows", "6",
                 "--held-out", "2", "--seq-len", "12", "--batch-size", "16", "--draft-vocab", "300",
                 "--eval-every", "2", "--checkpoint-every", "2", "--out", str(tmp_path / "heads")]
    result = CliRunner().invoke(app, [*arguments, "--steps", "4"])
    assert result.exit_code == 0, result.output
    curve = json.loads((tmp_path / "heads" / CURVE_JSON).read_text())
    assert curve["label"] == "Medusa" and [point["step"] for point in curve["points"]] == [0, 2, 4]
    assert [point["tokens"] for point in curve["points"]] == [0, 32, 64]  # 16 positions a step
    assert all(len(point["top1_per_depth"]) == 3 and point["tau"] >= 1 for point in curve["points"])
    assert (tmp_path / "heads" / "curve.png").exists()
    resumed = CliRunner().invoke(app, [*arguments, "--steps", "6"])
    assert resumed.exit_code == 0, resumed.output
    steps = [point["step"] for point in json.loads((tmp_path / "heads" / CURVE_JSON).read_text())["points"]]
    assert steps == [0, 2, 4, 6]
