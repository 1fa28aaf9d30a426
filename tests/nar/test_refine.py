"""Iterative refinement: the corruption of the denoising objective (hand-computed, deterministic for a generator,
never on padding), the training loss's passes (each refinement pass reads its row's corrupted target or the
previous pass's argmax), decoding to a fixed point or max_iterations passes (with fake passes, and against a
one-row-at-a-time reference with the real network), training, and save/load."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from accelgen.nar import refine
from accelgen.nar.backbone import length_loss, masked_cross_entropy
from accelgen.nar.mask_predict import CMLMModel
from accelgen.nar.refine import (KEEP, REPEAT, REPLACE, SWAP, RefineModel, apply_corruptions,
                                 corrupt_targets, draw_corruptions, initial_pass, refine_decode, refinement_pass)
from accelgen.nar.tokens import EOS, NEVER_GENERATED, PAD, SPECIALS, fixed_length_tokens, pad_sequences
from accelgen.nar.train import TrainSettings, train_model


@pytest.fixture(scope="module")
def model(trained):
    return trained(RefineModel, 60, training_passes=1)  # one refinement pass per step: the cheapest to train


# --- the corruption ------------------------------------------------------------------------------------------------


def test_corruptions_act_left_to_right_on_real_tokens_only():
    targets, target_mask = pad_sequences([[10, 11, 12, 13, 14], [20, 21, 22], [30, 31, 32, 33], [40, 41, 42]], 5)
    operations = torch.tensor([[SWAP, KEEP, REPEAT, KEEP, REPLACE],
                               [REPEAT, SWAP, SWAP, REPLACE, REPEAT],  # a swap into padding, ops on padding: nothing
                               [SWAP, SWAP, SWAP, KEEP, KEEP],  # the first token bubbles to the end
                               [REPEAT, REPEAT, KEEP, KEEP, KEEP]])  # a repeat repeated
    random_tokens = torch.full((4, 5), 99)
    corrupted = apply_corruptions(targets, target_mask, operations, random_tokens)
    assert corrupted.tolist() == [[11, 10, 12, 12, 99],
                                  [20, 22, 20, PAD, PAD],
                                  [31, 32, 33, 30, PAD],
                                  [40, 40, 40, PAD, PAD]]
    assert torch.equal(apply_corruptions(targets, target_mask, torch.full((4, 5), KEEP), random_tokens), targets)


def test_corruption_draws_are_deterministic_for_a_generator_and_never_touch_padding():
    lengths = torch.randint(1, 13, (3000,), generator=torch.Generator().manual_seed(5))
    target_mask = torch.arange(12) < lengths.unsqueeze(1)
    targets = torch.where(target_mask, torch.arange(12) + 10, PAD)  # distinct real tokens: every change shows

    operations, random_tokens = draw_corruptions(target_mask, 0.3, 64, torch.Generator().manual_seed(0))
    again, again_tokens = draw_corruptions(target_mask, 0.3, 64, torch.Generator().manual_seed(0))
    other, _ = draw_corruptions(target_mask, 0.3, 64, torch.Generator().manual_seed(1))
    assert torch.equal(operations, again) and torch.equal(random_tokens, again_tokens)
    assert not torch.equal(operations, other)
    assert (operations[~target_mask] == KEEP).all()
    real = operations[target_mask]
    for kind in (REPLACE, REPEAT, SWAP):  # each a third of the rate (~3900 draws per kind; sd ~ 0.003)
        assert abs(float((real == kind).float().mean()) - 0.1) < 0.015, kind
    assert int(random_tokens.min()) >= len(SPECIALS) and int(random_tokens.max()) < 64  # never a special
    assert (draw_corruptions(target_mask, 0.0, 64, torch.Generator())[0] == KEEP).all()

    corrupted = corrupt_targets(targets, target_mask, 1.0, 64, torch.Generator().manual_seed(0))
    assert torch.equal(corrupted, corrupt_targets(targets, target_mask, 1.0, 64, torch.Generator().manual_seed(0)))
    assert (corrupted[~target_mask] == PAD).all() and (corrupted[target_mask] != PAD).all()
    assert float((corrupted != targets)[target_mask].float().mean()) > 0.6  # rate 1: most tokens move or change


def test_training_inputs_are_drawn_from_the_generator_and_pad_where_the_targets_do(seeded, tiny_config, copy_task):
    model = seeded(RefineModel, tiny_config(), training_passes=2, denoising=0.5)
    rows = copy_task[1]
    batch = {name: tensor[:200] for name, tensor in rows.items()}
    drawn = model.training_inputs(batch, torch.Generator().manual_seed(0))
    again = model.training_inputs(batch, torch.Generator().manual_seed(0))
    other = model.training_inputs(batch, torch.Generator().manual_seed(1))
    assert drawn["corrupted"].shape == (200, 2, batch["tgt"].shape[1]) and drawn["denoised"].shape == (200, 2)
    assert torch.equal(drawn["corrupted"], again["corrupted"]) and torch.equal(drawn["denoised"], again["denoised"])
    assert not torch.equal(drawn["corrupted"], other["corrupted"])
    for step in range(2):
        assert (drawn["corrupted"][:, step][~batch["tgt_mask"]] == PAD).all()
        assert (drawn["corrupted"][:, step][batch["tgt_mask"]] != PAD).all()
    assert not torch.equal(drawn["corrupted"][:, 0], drawn["corrupted"][:, 1])  # each pass its own corruption
    assert 0.35 < float(drawn["denoised"].float().mean()) < 0.65
    assert model.training_inputs(drawn, torch.Generator()) is drawn  # a batch that brings its own keeps them


# --- the training loss ---------------------------------------------------------------------------------------------


def test_each_refinement_pass_reads_its_rows_corrupted_target_or_the_previous_argmax(seeded, tiny_config, copy_task,
                                                                                      monkeypatch):
    model = seeded(RefineModel, tiny_config(), training_passes=3, denoising=0.5)
    rows = copy_task[1]
    batch = model.training_inputs({name: tensor[:16] for name, tensor in rows.items()},
                                  torch.Generator().manual_seed(3))
    assert batch["denoised"].any() and not batch["denoised"].all()
    calls = []  # (its input tokens, its logits), the first pass's first
    first, later = refine.initial_logits, refine.refinement_logits

    def record_first(*args):
        logits, mask = first(*args)
        calls.append((None, logits))
        return logits, mask

    def record_later(model, tokens, *args):
        logits = later(model, tokens, *args)
        calls.append((tokens.clone(), logits))
        return logits

    monkeypatch.setattr(refine, "initial_logits", record_first)
    monkeypatch.setattr(refine, "refinement_logits", record_later)
    loss, metrics = model.loss(batch)
    tgt, tgt_mask = batch["tgt"], batch["tgt_mask"]
    assert len(calls) == 1 + 3
    expected_token_losses = masked_cross_entropy(calls[0][1], tgt, tgt_mask)
    for step in range(3):
        inputs, logits = calls[step + 1]
        allowed = calls[step][1].detach().clone()
        allowed[..., list(NEVER_GENERATED) + [EOS]] = float("-inf")  # the length is decided: no special, no EOS
        previous = torch.where(tgt_mask, allowed.argmax(-1), PAD)
        denoised = batch["denoised"][:, step]
        assert torch.equal(inputs[denoised], batch["corrupted"][denoised, step])
        assert torch.equal(inputs[~denoised], previous[~denoised])
        expected_token_losses = expected_token_losses + masked_cross_entropy(logits, tgt, tgt_mask)
    memory = model.backbone.encode(batch["src"], batch["src_mask"])
    expected = expected_token_losses + length_loss(model.backbone, memory, batch["src_mask"], tgt_mask)
    torch.testing.assert_close(loss, expected)
    assert metrics["last_pass_loss"] == pytest.approx(float(masked_cross_entropy(calls[-1][1], tgt, tgt_mask).detach()))
    loss.backward()
    assert float(model.refinement_marker.grad.abs().sum()) > 0  # the marker is learnt


def test_training_lowers_the_held_out_loss(seeded, tiny_config, copy_task):
    _, rows, held_out, _ = copy_task
    model = seeded(RefineModel, tiny_config(dropout=0.1), training_passes=2)
    result = train_model(model, rows, TrainSettings(steps=30, batch_size=32, learning_rate=3e-3, eval_every=15),
                         held_out=held_out)
    steps, losses = zip(*result["held_out"])
    assert steps == (0, 15, 30)
    assert losses[2] < 0.6 * losses[0], losses  # observed ~0.39 (13.3 -> 5.3)


# --- decoding ------------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_passes(monkeypatch):
    """fake_passes(changes): a first pass writing [20 - changes[row], 7, 8] for each row and a refinement pass that
    adds one to the first token until it is 20: row r changes for changes[r] passes, then stays. Returns the list of
    rows each refinement pass was given."""

    def install(changes: list[int]) -> list[int]:
        calls = []

        def first(model, src_ids, src_mask, memory, lengths):
            tokens = torch.tensor([[20 - change, 7, 8] for change in changes])
            return tokens, torch.ones_like(tokens, dtype=torch.bool)

        def refined(model, tokens, target_mask, memory, src_mask):
            calls.append(len(tokens))
            tokens = tokens.clone()
            tokens[:, 0] = (tokens[:, 0] + 1).clamp(max=20)
            return tokens

        monkeypatch.setattr(refine, "initial_pass", first)
        monkeypatch.setattr(refine, "refinement_pass", refined)
        return calls

    return install


def sources(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.arange(rows * 4).view(rows, 4) % 50 + 5
    return src, torch.ones_like(src, dtype=torch.bool)


def test_an_unchanged_output_stops_after_one_refinement_pass(seeded, tiny_config, fake_passes):
    calls = fake_passes([0, 0, 0])
    result = refine_decode(seeded(RefineModel, tiny_config()), *sources(3), max_iterations=10)
    assert result.passes == [1, 1, 1] and result.converged == [True] * 3 and calls == [3]
    assert result.sequences == [[20, 7, 8]] * 3


def test_a_row_changing_for_k_passes_runs_k_plus_one_and_leaves_the_batch_when_fixed(seeded, tiny_config,
                                                                                     fake_passes):
    calls = fake_passes([0, 1, 3, 5])
    result = refine_decode(seeded(RefineModel, tiny_config()), *sources(4), max_iterations=10)
    assert result.passes == [1, 2, 4, 6] and result.converged == [True] * 4
    assert result.sequences == [[20, 7, 8]] * 4
    assert calls == [4, 3, 2, 2, 1, 1]  # only the rows still changing are refined


def test_max_iterations_caps_the_refinement_passes(seeded, tiny_config, fake_passes):
    model = seeded(RefineModel, tiny_config())
    calls = fake_passes([0, 1, 3, 5])
    result = refine_decode(model, *sources(4), max_iterations=3)
    assert result.passes == [1, 2, 3, 3] and calls == [4, 3, 2]
    assert result.converged == [True, True, False, False]  # row 2 reached 20 at its third pass, unchecked
    assert [sequence[0] for sequence in result.sequences] == [20, 20, 20, 18]
    assert model.generate(*sources(4), max_iterations=3) == result.sequences
    nothing = refine_decode(model, *sources(4), max_iterations=0)  # the first pass alone
    assert nothing.passes == [0] * 4 and nothing.converged == [False] * 4
    assert [sequence[0] for sequence in nothing.sequences] == [20, 19, 17, 15]
    with pytest.raises(ValueError, match="max_iterations"):
        refine_decode(model, *sources(4), max_iterations=-1)


@pytest.mark.parametrize("steps", [0, 60])
def test_batched_decoding_is_the_one_row_chain_of_passes(steps, model, seeded, tiny_config, copy_task):
    """The real network: each row's output and passes are those of running its own chain alone, a pass at a time
    until the output stops changing; a converged output is a fixed point of one more pass."""
    network = model if steps else seeded(RefineModel, tiny_config())  # untrained: refinements that wander
    rows = copy_task[2]
    src, src_mask = rows["src"][:12], rows["src_mask"][:12]
    result = refine_decode(network, src, src_mask, max_iterations=4)
    for row in range(12):
        row_src, row_mask = src[row:row + 1], src_mask[row:row + 1]
        memory = network.backbone.encode(row_src, row_mask)
        length = network.backbone.length_logits(memory, row_mask).argmax(-1) + 1
        tokens, target_mask = initial_pass(network, row_src, row_mask, memory, length)
        passes, converged = 0, False
        while passes < 4 and not converged:
            refined = refinement_pass(network, tokens, target_mask, memory, row_mask)
            passes, converged, tokens = passes + 1, torch.equal(refined, tokens), refined
        assert (result.sequences[row], result.passes[row], result.converged[row]) == \
            (tokens[0].tolist(), passes, converged), row
        assert len(result.sequences[row]) == int(length)
        assert not set(result.sequences[row]) & set(NEVER_GENERATED + (EOS,))
    if steps:
        assert all(result.converged) and len({tuple(sequence) for sequence in result.sequences}) > 6
    else:
        assert max(result.passes) > 1  # untrained, some row changes more than once


def test_best_tokens_skip_specials_and_pad_padding():
    logits = torch.zeros(1, 3, 8)
    logits[0, 0, EOS], logits[0, 0, 6] = 5.0, 1.0  # EOS wins the raw argmax, 6 the allowed one
    logits[0, 1, PAD], logits[0, 1, 7] = 5.0, 1.0
    logits[0, 2, 5] = 9.0  # padding: PAD whatever wins
    assert fixed_length_tokens(logits, torch.tensor([[True, True, False]])).tolist() == [[6, 7, PAD]]


# --- saving, options --------------------------------------------------------------------------------------------


def test_a_saved_model_decodes_the_same_after_loading(model, seeded, tiny_config, copy_task, tmp_path):
    rows = copy_task[2]
    model.save(tmp_path / "refine")
    loaded = RefineModel.load(tmp_path / "refine")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert "refinement_marker" in loaded.state_dict()
    assert refine_decode(loaded, rows["src"], rows["src_mask"]) == refine_decode(model, rows["src"], rows["src_mask"])
    options = dict(training_passes=2, denoising=0.25, corruption_rate=0.1)
    seeded(RefineModel, tiny_config(), **options).save(tmp_path / "options")
    assert RefineModel.load(tmp_path / "options").options() == options
    with pytest.raises(ValueError, match="not a 'mask-predict' one"):
        CMLMModel.load(tmp_path / "refine")


@pytest.mark.parametrize("options, problem", [({"training_passes": 0}, "training_passes"),
                                              ({"denoising": 1.5}, "denoising"),
                                              ({"denoising": -0.1}, "denoising"),
                                              ({"corruption_rate": 2.0}, "corruption_rate")])
def test_bad_options_are_refused(options, problem, tiny_config):
    with pytest.raises(ValueError, match=problem):
        RefineModel(tiny_config(), **options)


def test_a_vocabulary_of_specials_only_and_a_batch_of_other_passes_are_refused(seeded, tiny_config, copy_task):
    with pytest.raises(ValueError, match="no token beyond"):
        RefineModel(dataclasses.replace(tiny_config(), vocab_size=len(SPECIALS)))
    rows = copy_task[1]
    batch = seeded(RefineModel, tiny_config(), training_passes=2).training_inputs(
        {name: tensor[:4] for name, tensor in rows.items()}, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="training_passes"):
        seeded(RefineModel, tiny_config(), training_passes=3).loss(batch)
