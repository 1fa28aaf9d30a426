"""PaSS training: the slots' training layout computes what drafting computes, training lowers the slots' loss
and touches nothing else, and the command line trains embeddings that `generate --method pass` uses. (Whether
trained slots are right on held-out text is measured on the real models: `evaluation.json`, docs.)"""

import json

import pytest
import torch

from accelgen.heads.pass_embeddings import LookaheadEmbeddings
from accelgen.models.runner import ModelRunner
from accelgen.train.loop import ScaleOut
from accelgen.train.pass_embeddings import (PassConfig, evaluate_pass, lookahead_layout, new_embeddings, random_cuts,
                                            slot_logits, train_pass)


def test_each_cut_sees_its_window_prefix_and_its_own_earlier_slots():
    positions, allowed = lookahead_layout(torch.tensor([2, 5]), count=2, length=8)
    assert positions.tolist() == [3, 4, 6, 7]
    window, slots = allowed[:, :8], allowed[:, 8:]
    assert window.sum(1).tolist() == [3, 3, 6, 6]  # positions 0..t
    assert slots.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


def test_training_layout_computes_what_drafting_computes(tiny_target, assert_reordered):
    """Slots appended at several cuts in one forward give the logits the runner gives when it feeds the window
    up to a cut and then the slots, as drafting does."""
    embeddings = new_embeddings(tiny_target, 3)
    window = torch.randint(3, 1000, (1, 20), generator=torch.Generator().manual_seed(0))
    cuts = torch.tensor([[4, 9, 15]])
    with torch.no_grad():
        logits, labels = slot_logits(tiny_target, embeddings, window, cuts)
    for index, cut in enumerate(cuts[0].tolist()):
        runner = ModelRunner(tiny_target)
        runner.forward(window[0, :cut])
        drafted = runner.forward(window[0, cut : cut + 1], appended=embeddings.vectors.detach())  # (1 + k, vocab)
        assert_reordered(logits[0, 3 * index : 3 * index + 3], drafted[1:])
        full = tiny_target(window[:, : cut + 4]).logits[0].argmax(-1)
        assert labels[0, 3 * index : 3 * index + 3].tolist() == full[cut + 1 : cut + 4].tolist()


def test_cuts_leave_room_for_the_labels():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        cuts = random_cuts(16, count=4, cuts=8, generator=generator)
        assert cuts.max() + 4 <= 15 and len(set(cuts.tolist())) == len(cuts)
    with pytest.raises(ValueError, match="too short for 4 look-ahead slots"):
        random_cuts(8, count=4, cuts=2, generator=generator)


def test_training_lowers_the_slots_loss_and_leaves_the_model_alone(tiny_target, tiny_target_windows):
    """On a few windows the slots learn their labels: the loss falls (with gradients reaching only the slots)."""
    rows = []
    before = [parameter.clone() for parameter in tiny_target.parameters()]
    train_pass(tiny_target, tiny_target_windows[:2], PassConfig(count=2, steps=80, batch_size=2, cuts=6,
                                                                learning_rate=0.1), progress=rows.append)
    first, last = (sum(row["loss"] for row in part) / len(part) for part in (rows[:5], rows[-5:]))
    assert last < first - 1.0, (first, last)
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_target.parameters()))
    assert all(parameter.requires_grad for parameter in tiny_target.parameters())


def test_gradient_accumulation_trains_the_same_embeddings(tiny_target, tiny_target_windows):
    config = PassConfig(count=2, steps=2, batch_size=4, cuts=6, learning_rate=0.1)
    whole, halves = (train_pass(tiny_target, tiny_target_windows, config, scale=scale).vectors.detach()
                     for scale in (None, ScaleOut(grad_accum=2)))
    # the batch's gradient summed in two halves rounds otherwise; Adam can scale that up to ~1e-4 × the step (0.1)
    torch.testing.assert_close(halves, whole, rtol=0, atol=1e-5)


def test_evaluation_counts_slots_right_in_a_row(tiny_target, tiny_target_windows):
    evaluation = evaluate_pass(tiny_target, new_embeddings(tiny_target, 3), tiny_target_windows[:2], cuts=5)
    assert evaluation["positions"] == 10 and len(evaluation["top1"]) == 3
    assert 0 <= evaluation["mean_slots_in_a_row"] <= 3 * max(evaluation["top1"])


def test_the_command_trains_embeddings_that_generate_uses(command_inputs, tmp_path):
    from typer.testing import CliRunner

    from accelgen.cli import app

    model, dataset = command_inputs(seed=0)
    out = tmp_path / "pass"
    trained = CliRunner().invoke(app, ["train", "pass", "--model", str(model), "--dataset", dataset, "--out", str(out),
                                       "--count", "3", "--windows", "12", "--held-out", "2", "--seq-len", "24",
                                       "--steps", "5", "--cuts", "4"])
    assert trained.exit_code == 0, trained.output
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert len(evaluation["top1"]) == 3 and evaluation["config"]["count"] == 3
    assert len(LookaheadEmbeddings.load(out)) == 3
    runs = [CliRunner().invoke(app, ["generate", "def add(a, b):", "--model", str(model), "-n", "12", "--json",
                                     *extra]) for extra in ([], ["--method", "pass", "--head", str(out)])]
    assert all(run.exit_code == 0 for run in runs), runs[1].output
    plain, passed = (json.loads(run.stdout.strip().splitlines()[-1]) for run in runs)
    assert passed["token_ids"] == plain["token_ids"]
