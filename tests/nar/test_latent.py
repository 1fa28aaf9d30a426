"""Latent Transformer: DVQ picks each slice's nearest code of its own codebook (a brute-force search agrees) and
passes the decoder's gradient straight through to the encoder; decoding is ceil(T / c) greedy steps of the latent
model, the codes its teacher-forced pass predicts, then exactly one parallel token pass; training lowers the
held-out loss; a saved model loads with the same outputs."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from accelgen.nar.backbone import masked_cross_entropy
from accelgen.nar.latent import (LatentTransformerModel, code_vectors, decomposed_vector_quantise, greedy_latents,
                                 latent_counts, nearest_codes)
from accelgen.nar.nat import NATModel
from accelgen.nar.train import TrainSettings, held_out_loss, train_model


def brute_force_codes(latents: torch.Tensor, codebooks: torch.Tensor) -> list:
    """Per latent vector and slice, the index of the first code at the smallest squared distance, in plain Python."""
    slices, codes, size = codebooks.shape
    found = []
    for vector in latents.reshape(-1, slices * size).tolist():
        row = []
        for piece in range(slices):
            part = vector[piece * size:(piece + 1) * size]
            distances = [sum((a - b) ** 2 for a, b in zip(part, code)) for code in codebooks[piece].tolist()]
            row.append(distances.index(min(distances)))
        found.append(row)
    return found


def test_each_slice_takes_the_nearest_code_of_its_own_codebook():
    codebooks = torch.tensor([[[0.0, 0.0], [1.0, -2.0], [5.0, 5.0]],  # slice 0's codes
                              [[0.0, 0.0], [1.0, 1.0], [-1.0, 0.0]]])  # slice 1's
    latents = torch.tensor([[[0.9, -2.0, 0.1, 0.0],  # slice 0 nearest [1, -2], slice 1 nearest [0, 0]
                             [4.0, 4.0, -0.6, 0.1],  # [5, 5]; [-1, 0]
                             [0.5, -1.0, 0.5, 0.5]]])  # a tie in each slice: the lower index ([0, 0] both)
    mask = torch.tensor([[True, True, False]])
    quantised, codes, codebook_loss, commitment_loss = decomposed_vector_quantise(latents, codebooks, mask)
    assert codes.tolist() == [[[1, 0], [2, 2], [0, 0]]]
    assert quantised.tolist() == [[[1.0, -2.0, 0.0, 0.0], [5.0, 5.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]]
    # the mean squared distance per dimension over the two real latents (the third is padding)
    squared = (0.01 + 0 + 0.01 + 0) + (1 + 1 + 0.16 + 0.01)
    assert codebook_loss.item() == pytest.approx(squared / 8) and commitment_loss.item() == pytest.approx(squared / 8)

    generator = torch.Generator().manual_seed(0)
    codebooks = torch.randn(3, 7, 4, generator=generator)
    latents = torch.randn(5, 6, 12, generator=generator)
    codes = nearest_codes(latents, codebooks)
    assert codes.reshape(-1, 3).tolist() == brute_force_codes(latents, codebooks)
    # slices are searched apart: a single table of all 7^3 tuples, searched whole, finds the same tuples
    tuples = torch.tensor(list(itertools.product(range(7), repeat=3)))
    table = code_vectors(tuples, codebooks)  # (343, 12)
    joint = ((latents.reshape(-1, 1, 12) - table) ** 2).sum(-1).argmin(-1)
    assert tuples[joint].tolist() == codes.reshape(-1, 3).tolist()


def test_the_straight_through_estimator_passes_the_decoders_gradient_to_the_encoder(seeded, tiny_config, copy_task):
    latents = torch.randn(2, 3, 8, requires_grad=True)
    codebooks = torch.randn(2, 5, 4, requires_grad=True)
    upstream = torch.randn(2, 3, 8)
    quantised, _, codebook_loss, commitment_loss = decomposed_vector_quantise(latents, codebooks,
                                                                              torch.ones(2, 3, dtype=torch.bool))
    (quantised * upstream).sum().backward()
    assert torch.equal(latents.grad, upstream)  # the identity, backward
    assert codebooks.grad is None  # codes learn only from the codebook loss
    codebook_loss.backward()
    assert latents.grad is not None and torch.equal(latents.grad, upstream) and codebooks.grad.abs().sum() > 0
    commitment_loss.backward()
    assert not torch.equal(latents.grad, upstream)

    model = seeded(LatentTransformerModel, tiny_config())
    rows = copy_task[2]
    src, src_mask, tgt, tgt_mask = rows["src"][:8], rows["src_mask"][:8], rows["tgt"][:8], rows["tgt_mask"][:8]

    def compressor_gradient(straight_through: bool) -> float:
        model.zero_grad()
        memory = model.backbone.encode(src, src_mask)
        encoded, latent_mask = model.encode_latents(tgt, tgt_mask, memory, src_mask)
        quantised, codes, _, _ = decomposed_vector_quantise(encoded, model.codebooks, latent_mask)
        decoded = quantised if straight_through else code_vectors(codes, model.codebooks)
        masked_cross_entropy(model.token_logits(decoded, tgt_mask, memory, src_mask), tgt, tgt_mask).backward()
        weight = model.compressor.compress.weight.grad
        return 0.0 if weight is None else float(weight.abs().sum())

    assert compressor_gradient(straight_through=True) > 0  # the reconstruction loss reaches the encoder
    assert compressor_gradient(straight_through=False) == 0  # and only through the estimator


def test_a_targets_latents_do_not_depend_on_the_rest_of_its_batch(seeded, tiny_config, copy_task, assert_reordered):
    model = seeded(LatentTransformerModel, tiny_config(), compression=4)
    rows = copy_task[2]
    src, src_mask, tgt, tgt_mask = rows["src"][:6], rows["src_mask"][:6], rows["tgt"][:6], rows["tgt_mask"][:6]
    assert latent_counts(torch.tensor([1, 2, 3, 4, 5, 8, 9]), 4).tolist() == [1, 1, 1, 1, 2, 2, 3]
    memory = model.backbone.encode(src, src_mask)
    batched, latent_mask = model.encode_latents(tgt, tgt_mask, memory, src_mask)
    assert latent_mask.sum(dim=1).tolist() == latent_counts(tgt_mask.sum(dim=1), 4).tolist()
    for row in range(6):
        length = int(tgt_mask[row].sum())
        alone, _ = model.encode_latents(tgt[row:row + 1, :length], tgt_mask[row:row + 1, :length],
                                        memory[row:row + 1], src_mask[row:row + 1])
        assert alone.shape[1] == math.ceil(length / 4)
        assert_reordered(batched[row, :alone.shape[1]], alone[0])


@pytest.mark.parametrize("compression, lengths", [(2, [7]), (4, [7]), (4, [8]), (3, [2, 7, 5])])
def test_decoding_is_t_over_c_latent_steps_then_one_token_pass(compression, lengths, seeded, tiny_config, copy_task,
                                                               monkeypatch):
    model = seeded(LatentTransformerModel, tiny_config(), compression=compression)
    rows = copy_task[2]
    src, src_mask = rows["src"][:len(lengths)], rows["src_mask"][:len(lengths)]
    length_logits = torch.zeros(len(lengths), 12)
    length_logits[torch.arange(len(lengths)), torch.tensor(lengths) - 1] = 5.0  # class T - 1 is length T
    monkeypatch.setattr(model.backbone, "length_logits", lambda memory, mask: length_logits)
    calls = []
    prior, decode = model.prior.forward, model.backbone.decode
    monkeypatch.setattr(model.prior, "forward", lambda *args: calls.append("latent") or prior(*args))
    monkeypatch.setattr(model.backbone, "decode", lambda *args: calls.append("tokens") or decode(*args))
    outputs = model.generate(src, src_mask)
    assert calls == ["latent"] * math.ceil(max(lengths) / compression) + ["tokens"]
    assert [len(output) for output in outputs] == lengths


def test_the_latent_steps_decode_what_the_teacher_forced_latent_model_predicts(trained, copy_task):
    model = trained(LatentTransformerModel, 60)
    rows = copy_task[2]
    src, src_mask = rows["src"][:8], rows["src_mask"][:8]
    memory = model.backbone.encode(src, src_mask)
    codes = greedy_latents(model, memory, src_mask, count=4)  # (8, 4, slices)
    logits = model.prior(code_vectors(codes[:, :-1], model.codebooks), memory, src_mask)  # every position at once
    assert torch.equal(logits.argmax(-1), codes)
    assert len({tuple(row) for row in codes.flatten(1).tolist()}) > 1  # the latents differ with the source
    outputs = model.generate(src, src_mask)
    assert len({tuple(output) for output in outputs}) > 4


def test_training_lowers_the_held_out_loss(seeded, tiny_config, copy_task):
    _, rows, held_out, _ = copy_task
    model = seeded(LatentTransformerModel, tiny_config(dropout=0.1))
    shown = []
    result = train_model(model, rows, TrainSettings(steps=30, batch_size=32, learning_rate=3e-3, eval_every=15),
                         held_out=held_out, progress=shown.append)
    steps, losses = zip(*result["held_out"])
    assert steps == (0, 15, 30)
    assert losses[2] < 0.6 * losses[0], losses  # measured 0.47-0.55 of the first over four seeds
    assert shown[-1]["token_loss"] < 0.5 * shown[0]["token_loss"], (shown[0], shown[-1])  # measured ~0.2


def test_a_saved_model_loads_with_the_same_outputs(trained, copy_task, tmp_path):
    model = trained(LatentTransformerModel, 15, compression=4, slices=4, codes=8)
    rows = copy_task[2]
    model.save(tmp_path)
    loaded = LatentTransformerModel.load(tmp_path)
    assert loaded.options() == {"compression": 4, "slices": 4, "codes": 8, "latent_layers": 1, "commitment": 0.25}
    assert loaded.generate(rows["src"], rows["src_mask"]) == model.generate(rows["src"], rows["src_mask"])
    assert held_out_loss(loaded, rows) == held_out_loss(model, rows)
    with pytest.raises(ValueError, match="not a 'nat' one"):
        NATModel.load(tmp_path)


@pytest.mark.parametrize("options, problem", [
    ({"compression": 0}, "compression"), ({"compression": 13}, "compression"), ({"slices": 3}, "slices"),
    ({"slices": 0}, "slices"), ({"codes": 1}, "codes"), ({"latent_layers": 0}, "latent_layers"),
    ({"commitment": -0.1}, "commitment"), ({"commitment": float("nan")}, "commitment")])
def test_bad_options_are_refused(options, problem, tiny_config):
    with pytest.raises(ValueError, match=problem):
        LatentTransformerModel(tiny_config(), **options)


def test_targets_longer_than_the_model_reads_are_refused(seeded, tiny_config, copy_task):
    model = seeded(LatentTransformerModel, tiny_config(max_target_len=4))
    rows = copy_task[2]
    with pytest.raises(ValueError, match="max_target_len"):
        model.loss({name: tensor[:4] for name, tensor in rows.items()})
