"""AR -> NAR curriculum (FCL-NAT) with DePA's options: the pace and the schedule, the mixed inputs and masks against a
sentence-by-sentence brute force, step 0 is the AR student's teacher-forced pass and the end of the curriculum the
pure NAR pass, the right-to-left phase hides each token and the ones before it, DePA's input transformation,
training, exact resume (the step counter is saved), save/load, one-pass decoding, and bad options."""

from __future__ import annotations

import math

import pytest
import torch

from accelgen.nar.ar import ARStudent
from accelgen.nar.curriculum import (CurriculumModel, attentive_transform, curriculum_positions, curriculum_stage,
                                     pace, self_attention_mask, shift_left)
from accelgen.nar.nat import uniform_positions
from accelgen.nar.tokens import BOS, EOS, NEVER_GENERATED, PAD, append_eos, pad_sequences
from accelgen.nar.train import TrainSettings, train_model


def first_rows(rows: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
    return {name: tensor[:count] for name, tensor in rows.items()}


def test_the_pace_and_the_schedule():
    assert pace(0.25, "linear") == 0.25 and pace(-1.0, "linear") == 0.0 and pace(2.0, "linear") == 1.0
    assert pace(0.0, "logarithmic") == 0.0 and pace(1.0, "logarithmic") == pytest.approx(1.0)
    assert pace(0.5, "logarithmic") == pytest.approx(math.log(100.5) / math.log(200))  # log(i)/log(I), i = 100.5
    assert pace(0.05, "logarithmic") > 0.4  # fast early, slow near NAR
    stages = [curriculum_stage(step, 2, 3, 4, "linear") for step in range(11)]
    assert stages == [(0.0, False), (0.0, False),  # left to right
                      (0.0, True), (0.0, True), (0.0, True),  # right to left
                      (0.0, True), (0.25, True), (0.5, True), (0.75, True),  # the curriculum, from right to left
                      (1.0, True), (1.0, True)]  # NAR
    assert curriculum_stage(3, 3, 0, 0, "logarithmic") == (1.0, False)  # no curriculum: a direct switch
    assert curriculum_stage(5, 3, 0, 4, "linear") == (0.5, False)
    with pytest.raises(ValueError, match="pacing"):
        pace(0.5, "exponential")


def test_positions_are_a_share_of_each_sentence_and_the_right_to_left_inputs_read_the_next_token():
    _, target_mask = pad_sequences([[9] * 7, [9] * 3, [9]] * 20)
    chosen = curriculum_positions(target_mask, 0.4, torch.Generator().manual_seed(0))
    assert not (chosen & ~target_mask).any()
    assert chosen.sum(dim=1).tolist() == [3, 1, 0] * 20  # round(0.4·n): 2.8, 1.2, 0.4
    assert len({tuple(row) for row in chosen[0::3].int().tolist()}) > 5  # drawn, not fixed
    assert torch.equal(chosen, curriculum_positions(target_mask, 0.4, torch.Generator().manual_seed(0)))
    assert torch.equal(curriculum_positions(target_mask, 1.0, torch.Generator()), target_mask)

    targets, target_mask = append_eos(*pad_sequences([[11, 12, 13], [21]]))
    assert shift_left(targets, target_mask).tolist() == [[12, 13, EOS, BOS], [EOS, BOS, PAD, PAD]]


def test_the_attention_mask_against_a_brute_force_reference():
    generator = torch.Generator().manual_seed(0)
    _, target_mask = pad_sequences([[9] * 6, [9] * 4, [9] * 2, [9] * 5])
    nar_queries = curriculum_positions(target_mask, 0.5, generator)
    backward = torch.tensor([False, True, False, True])
    mask = self_attention_mask(nar_queries, target_mask, backward)
    for row in range(4):
        for i in range(6):
            for j in range(6):
                if not target_mask[row, i] or nar_queries[row, i]:
                    hidden = False  # an NAR row (or padding) sees everything the key padding lets it see
                else:
                    hidden = j < i if backward[row] else j > i
                assert bool(mask[row, i, j]) == hidden, (row, i, j)


def test_at_step_zero_the_training_forward_is_the_ar_students(seeded, tiny_config, copy_task):
    model = seeded(CurriculumModel, tiny_config(), ar_steps=3).train()
    student = ARStudent(model.config).eval()
    student.backbone.load_state_dict(model.backbone.state_dict())
    batch = first_rows(copy_task[2], 8)
    drawn = model.training_inputs(batch, torch.Generator().manual_seed(0))
    assert int(model.trained_steps) == 1 and not drawn["nar_inputs"].any() and not drawn["backward"].any()
    model.eval()
    targets, target_mask = append_eos(batch["tgt"], batch["tgt_mask"])
    memory = model.backbone.encode(batch["src"], batch["src_mask"])
    logits = model.curriculum_logits(batch["src"], batch["src_mask"], memory, targets, target_mask,
                                     drawn["nar_inputs"], drawn["nar_queries"], drawn["backward"])
    expected = student.teacher_forced_logits(batch["src"], batch["src_mask"], targets, target_mask)
    assert torch.equal(logits[target_mask], expected[target_mask])
    _, metrics = model.loss(drawn)
    assert metrics["token_loss"] == pytest.approx(float(student.loss(batch)[0].detach()), rel=1e-6)
    assert metrics["nar_share"] == 0.0


def pure_nar_logits(model: CurriculumModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The NAR pass written out: each of the target + EOS positions reads the source embedding at its uniform copy
    position, no attention mask."""
    targets, target_mask = append_eos(batch["tgt"], batch["tgt_mask"])
    rows = []
    for row in range(len(targets)):
        copies = uniform_positions(int(batch["src_mask"][row].sum()), int(target_mask[row].sum()))
        copies += [0] * (targets.shape[1] - len(copies))  # padding positions: any input
        rows.append(model.backbone.embed_tokens(batch["src"][row])[copies])
    memory = model.backbone.encode(batch["src"], batch["src_mask"])
    hidden = model.backbone.decode(torch.stack(rows), target_mask, memory, batch["src_mask"])
    return model.backbone.logits(hidden)


def test_after_the_curriculum_the_training_forward_is_the_pure_nar_forward(seeded, tiny_config, copy_task):
    model = seeded(CurriculumModel, tiny_config(), ar_steps=2, curriculum_steps=4, pacing="linear").train()
    batch = first_rows(copy_task[2], 8)
    _, target_mask = append_eos(batch["tgt"], batch["tgt_mask"])
    model.trained_steps.fill_(4)  # halfway: λ = 0.5 of every sentence
    halfway = model.training_inputs(batch, torch.Generator().manual_seed(0))
    assert halfway["nar_inputs"].sum(dim=1).tolist() == (target_mask.sum(dim=1) * 0.5 + 0.5).floor().long().tolist()
    assert not torch.equal(halfway["nar_inputs"], halfway["nar_queries"])  # two separate draws

    model.trained_steps.fill_(6)  # ar_steps + curriculum_steps
    drawn = model.training_inputs(batch, torch.Generator().manual_seed(0))
    assert torch.equal(drawn["nar_inputs"], target_mask) and torch.equal(drawn["nar_queries"], target_mask)
    model.eval()
    targets, _ = append_eos(batch["tgt"], batch["tgt_mask"])
    memory = model.backbone.encode(batch["src"], batch["src_mask"])
    logits = model.curriculum_logits(batch["src"], batch["src_mask"], memory, targets, target_mask,
                                     drawn["nar_inputs"], drawn["nar_queries"], drawn["backward"])
    expected = pure_nar_logits(model, batch)
    assert torch.equal(logits[target_mask], expected[target_mask])
    held_out = model.training_inputs(batch, torch.Generator().manual_seed(0))  # eval mode: the NAR task, no step
    assert torch.equal(held_out["nar_inputs"], target_mask) and int(model.trained_steps) == 7


def test_a_mixed_step_equals_each_sentence_decoded_alone(seeded, tiny_config, copy_task, assert_reordered):
    """Mixed inputs and per-sentence masks (some rows right to left) against each sentence run alone, built
    position by position, with its own (T, T) mask and no padding."""
    model = seeded(CurriculumModel, tiny_config())
    batch = first_rows(copy_task[2], 6)
    targets, target_mask = append_eos(batch["tgt"], batch["tgt_mask"])
    generator = torch.Generator().manual_seed(3)
    nar_inputs = curriculum_positions(target_mask, 0.5, generator)
    nar_queries = curriculum_positions(target_mask, 0.5, generator)
    backward = torch.tensor([True, False] * 3)
    memory = model.backbone.encode(batch["src"], batch["src_mask"])
    logits = model.curriculum_logits(batch["src"], batch["src_mask"], memory, targets, target_mask, nar_inputs,
                                     nar_queries, backward)
    embed = model.backbone.embed_tokens
    for row in range(6):
        length = int(target_mask[row].sum())
        copies = uniform_positions(int(batch["src_mask"][row].sum()), length)
        inputs, hidden_pairs = [], torch.zeros(length, length, dtype=torch.bool)
        for i in range(length):
            if nar_inputs[row, i]:
                inputs.append(embed(batch["src"][row, copies[i]]))
            elif backward[row]:
                inputs.append(embed(torch.tensor(BOS if i == length - 1 else int(targets[row, i + 1]))))
            else:
                inputs.append(embed(torch.tensor(BOS if i == 0 else int(targets[row, i - 1]))))
            for j in range(length):
                if not nar_queries[row, i]:
                    hidden_pairs[i, j] = j < i if backward[row] else j > i
        alone = model.backbone.decode(torch.stack(inputs).unsqueeze(0), torch.ones(1, length, dtype=torch.bool),
                                      memory[row:row + 1], batch["src_mask"][row:row + 1], hidden_pairs)
        assert_reordered(logits[row, :length], model.backbone.logits(alone)[0])


@pytest.mark.parametrize("backward", [False, True])
def test_an_ar_position_never_sees_its_own_token_or_those_before_it_in_its_direction(backward, seeded, tiny_config):
    model = seeded(CurriculumModel, tiny_config())
    src, src_mask = pad_sequences([[5, 6, 7, 8, 9]])
    targets, target_mask = append_eos(*pad_sequences([[10, 11, 12, 13, 14]]))
    memory = model.backbone.encode(src, src_mask)
    none = torch.zeros_like(target_mask)

    def logits_of(ids):
        return model.curriculum_logits(src, src_mask, memory, ids, target_mask, none, none, torch.tensor([backward]))

    before = logits_of(targets)
    changed = targets.clone()
    changed[0, 2] = 15
    after = logits_of(changed)
    moved = [not torch.equal(before[0, i], after[0, i]) for i in range(6)]
    # left to right, position i reads targets < i: only 3.. move; right to left, targets > i: only ..1 move
    assert moved == ([True, True, False, False, False, False] if backward else
                     [False, False, False, True, True, True])


def test_depa_input_transformation_maps_the_copies_onto_target_embeddings(seeded, tiny_config, copy_task):
    queries = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])
    table = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    weights = torch.tensor([[math.e, 1.0, math.e], [1.0, math.e ** 2, math.e ** 2]])
    expected = (weights / weights.sum(dim=1, keepdim=True)) @ table
    torch.testing.assert_close(attentive_transform(queries, table)[0], expected)

    model = seeded(CurriculumModel, tiny_config(), input_transform=True)
    rows = copy_task[1]
    size = model.fit_target_vocabulary(rows)
    fitted = set(rows["tgt"][rows["tgt_mask"]].tolist()) | {EOS}
    assert size == len(fitted) and set(model.target_vocabulary.nonzero().squeeze(1).tolist()) == fitted
    batch = first_rows(copy_task[2], 3)
    _, target_mask = append_eos(batch["tgt"], batch["tgt_mask"])
    inputs = model.nar_decoder_inputs(batch["src"], batch["src_mask"], target_mask)
    plain = seeded(CurriculumModel, tiny_config()).nar_decoder_inputs(batch["src"], batch["src_mask"], target_mask)
    ids = torch.tensor(sorted(fitted))
    table = model.backbone.embed_tokens(ids)
    weights = (model.transform_query(plain) @ table.T).softmax(dim=-1)
    torch.testing.assert_close(inputs, weights @ table)
    with pytest.raises(ValueError, match="input_transform=True"):
        seeded(CurriculumModel, tiny_config()).fit_target_vocabulary(rows)


@pytest.mark.parametrize("options", [dict(ar_steps=5, curriculum_steps=15),
                                     dict(ar_steps=3, backward_steps=3, curriculum_steps=10, input_transform=True)],
                         ids=["fcl-nat", "depa"])
def test_training_lowers_the_held_out_loss(options, seeded, tiny_config, copy_task):
    _, rows, held_out, _ = copy_task
    model = seeded(CurriculumModel, tiny_config(dropout=0.1), **options)
    if model.input_transform:
        model.fit_target_vocabulary(rows)
    shown = []
    result = train_model(model, rows, TrainSettings(steps=30, batch_size=32, learning_rate=3e-3, eval_every=15),
                         held_out=held_out, progress=shown.append)
    steps, losses = zip(*result["held_out"])
    assert steps == (0, 15, 30)
    assert losses[2] < 0.6 * losses[0], losses  # the NAR loss: 7.7 -> 2.6-2.7 measured
    shares = [row["nar_share"] for row in shown]
    assert shares[0] == 0.0 and shares[-1] == 1.0 and 0.0 < shares[10] < 1.0  # AR, the curriculum, NAR
    assert int(model.trained_steps) == 30 and not model.training


def test_a_resumed_run_ends_with_the_weights_of_an_unbroken_one(seeded, tiny_config, copy_task, tmp_path):
    rows = copy_task[1]
    config = tiny_config(dropout=0.1)
    options = dict(ar_steps=1, backward_steps=1, curriculum_steps=3, pacing="linear", input_transform=True)
    settings = TrainSettings(steps=6, batch_size=16, learning_rate=3e-3, checkpoint_every=3)

    def fresh():
        model = seeded(CurriculumModel, config, **options)
        model.fit_target_vocabulary(rows)
        return model

    unbroken = fresh()
    train_model(unbroken, rows, settings)
    checkpoint = tmp_path / "checkpoint.pt"
    train_model(fresh(), rows, TrainSettings(**{**settings.__dict__, "steps": 3}), checkpoint=checkpoint)
    saved = torch.load(checkpoint, weights_only=False)  # and a copy of it with its step counter lost
    saved["module"]["trained_steps"].zero_()
    torch.save(saved, tmp_path / "counter_lost.pt")
    resumed = fresh()
    assert train_model(resumed, rows, settings, checkpoint=checkpoint)["resumed_at"] == 3  # mid-curriculum
    assert int(resumed.trained_steps) == 6
    for name, tensor in unbroken.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name

    restarted = fresh()
    assert train_model(restarted, rows, settings, checkpoint=tmp_path / "counter_lost.pt")["resumed_at"] == 3
    assert not torch.equal(restarted.backbone.embed.weight, unbroken.backbone.embed.weight)  # the schedule restarted


def test_save_and_load_give_the_same_outputs(trained, seeded, tiny_config, copy_task, tmp_path):
    rows = copy_task[2]
    model = trained(CurriculumModel, 30, ar_steps=5, curriculum_steps=15)
    loaded = CurriculumModel.load(model.save(tmp_path / "fcl"))
    assert loaded.options() == model.options() and int(loaded.trained_steps) == 30
    assert loaded.generate(rows["src"], rows["src_mask"]) == model.generate(rows["src"], rows["src_mask"])

    depa = seeded(CurriculumModel, tiny_config(), backward_steps=2, input_transform=True)
    depa.fit_target_vocabulary(copy_task[1])
    loaded = CurriculumModel.load(depa.save(tmp_path / "depa"))
    assert torch.equal(loaded.target_vocabulary, depa.target_vocabulary)
    assert loaded.generate(rows["src"], rows["src_mask"]) == depa.generate(rows["src"], rows["src_mask"])
    with pytest.raises(ValueError, match="not a 'ar' one"):
        ARStudent.load(tmp_path / "depa")


def test_decoding_is_one_pass_at_the_predicted_length(trained, copy_task, monkeypatch):
    model = trained(CurriculumModel, 30, ar_steps=5, curriculum_steps=15)
    rows = copy_task[2]
    src, src_mask = rows["src"][:8], rows["src_mask"][:8]
    lengths = (model.backbone.length_logits(model.backbone.encode(src, src_mask), src_mask).argmax(-1) + 1).tolist()
    passes = []
    decode = model.backbone.decode
    monkeypatch.setattr(model.backbone, "decode",
                        lambda *args, **kwargs: passes.append((len(args), kwargs)) or decode(*args, **kwargs))
    outputs = model.generate(src, src_mask)
    assert passes == [(4, {})]  # one pass, no attention mask
    assert [len(output) for output in outputs] == lengths
    assert not {EOS, *NEVER_GENERATED} & {token for output in outputs for token in output}
    assert len({tuple(output) for output in outputs}) > 4
    monkeypatch.undo()
    width = max(lengths) + 1
    target_mask = torch.arange(width) < torch.tensor(lengths).unsqueeze(1) + 1
    memory = model.backbone.encode(src, src_mask)
    logits = model.backbone.logits(model.backbone.decode(model.nar_decoder_inputs(src, src_mask, target_mask),
                                                         target_mask, memory, src_mask))
    logits[..., list(NEVER_GENERATED) + [EOS]] = float("-inf")
    assert outputs == [row[:length].tolist() for row, length in zip(logits.argmax(-1), lengths)]


@pytest.mark.parametrize("options, message", [
    ({"ar_steps": -1}, "ar_steps"), ({"backward_steps": 1.5}, "backward_steps"),
    ({"curriculum_steps": True}, "curriculum_steps"), ({"pacing": "ladder"}, "pacing"),
    ({"input_transform": "yes"}, "input_transform")])
def test_bad_options_raise(options, message, tiny_config):
    with pytest.raises(ValueError, match=message):
        CurriculumModel(tiny_config(), **options)


def test_a_batch_without_the_draws_is_refused(seeded, tiny_config, copy_task):
    model = seeded(CurriculumModel, tiny_config())
    batch = first_rows(copy_task[2], 4)
    with pytest.raises(ValueError, match="training_inputs"):
        model.loss(batch)
    drawn = model.training_inputs(batch, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="nar_inputs has shape"):
        model.loss({**drawn, "nar_inputs": drawn["nar_inputs"][:, :-1]})
