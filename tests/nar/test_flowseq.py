"""FlowSeq: the prior's flow is invertible and its log-determinant is the Jacobian's; padding changes nothing real;
the loss is the negative ELBO (checked against a brute-force Jacobian); argmax decoding is ε = 0 at the predicted
length, deterministic; noisy parallel decoding returns what its scorer scores best, in one batched call; training
lowers the held-out negative ELBO; a saved model decodes the same after loading."""

from __future__ import annotations

import pytest
import sacrebleu
import torch
from torch.autograd.functional import jacobian

from accelgen.nar.ar import ARStudent
from accelgen.nar.backbone import masked_cross_entropy
from accelgen.nar.flowseq import FlowSeqModel, length_candidates, noisy_parallel_decode
from accelgen.nar.mask_predict import CMLMModel
from accelgen.nar.nat import NATModel
from accelgen.nar.tokens import EOS, NEVER_GENERATED, PAD, fixed_length_tokens, length_mask, pad_sequences
from accelgen.nar.train import TrainSettings, held_out_loss, select_rows, train_model

SMALL = {"latent_dim": 8, "flow_steps": 1}  # the trained model every decoding test shares
STEPS = 60


def trained_flowseq(trained):
    return trained(FlowSeqModel, STEPS, **SMALL)


def shaken_flow_model(seeded, tiny_config, copy_task, **options):
    """(model, memory (1, S, width), src_mask (1, S)): a seeded model whose flow parameters are moved off their
    initial values (zero coupling outputs, identity actnorm), so every layer does something."""
    model = seeded(FlowSeqModel, tiny_config(), **options)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.prior_flow.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    rows = copy_task[2]
    src, src_mask = rows["src"][:1], rows["src_mask"][:1]
    return model, model.backbone.encode(src, src_mask).detach(), src_mask


def test_the_flow_is_invertible_and_its_log_determinant_is_the_jacobians(seeded, tiny_config, copy_task):
    model, memory, src_mask = shaken_flow_model(seeded, tiny_config, copy_task, latent_dim=4, flow_steps=2)
    flow, shape = model.prior_flow, (1, 3, 4)
    target_mask = torch.ones(shape[:2], dtype=torch.bool)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    latents, log_det = flow(noise, target_mask, memory, src_mask)
    back, inverse_log_det = flow.inverse(latents, target_mask, memory, src_mask)
    torch.testing.assert_close(back, noise, rtol=0, atol=1e-5)
    torch.testing.assert_close(inverse_log_det, -log_det, rtol=0, atol=1e-5)

    to_latents = jacobian(lambda flat: flow(flat.view(shape), target_mask, memory, src_mask)[0].flatten(),
                          noise.flatten())  # (12, 12)
    assert abs(float(torch.linalg.slogdet(to_latents).logabsdet) - float(log_det[0].detach())) < 1e-4
    to_noise = jacobian(lambda flat: flow.inverse(flat.view(shape), target_mask, memory, src_mask)[0].flatten(),
                        latents.detach().flatten())
    assert abs(float(torch.linalg.slogdet(to_noise).logabsdet) - float(inverse_log_det[0].detach())) < 1e-4
    # the couplings mix positions (they attend to the other target positions) and features
    assert to_latents[:4, 4:8].abs().max() > 1e-3 and to_latents[:4, :4].abs().min() > 1e-4
    # log p(z | x): the standard normal at f⁻¹(z) and the brute-force Jacobian of f⁻¹
    log_prob = flow.log_prob(latents, target_mask, memory, src_mask)
    reference = torch.distributions.Normal(0.0, 1.0).log_prob(back).sum() + torch.linalg.slogdet(to_noise).logabsdet
    assert abs(float(log_prob[0].detach()) - float(reference.detach())) < 1e-4


def test_padding_positions_change_nothing_real(seeded, tiny_config, copy_task):
    model, memory, src_mask = shaken_flow_model(seeded, tiny_config, copy_task, latent_dim=4, flow_steps=2)
    flow = model.prior_flow
    target_mask = torch.tensor([[True, True, True, False, False]])
    noise = torch.randn(1, 5, 4, generator=torch.Generator().manual_seed(1))  # not 0 at padding either
    latents, log_det = flow(noise, target_mask, memory, src_mask)
    unpadded, unpadded_log_det = flow(noise[:, :3], target_mask[:, :3], memory, src_mask)
    torch.testing.assert_close(latents[:, :3], unpadded, rtol=0, atol=1e-5)
    torch.testing.assert_close(log_det, unpadded_log_det, rtol=0, atol=1e-5)
    assert not latents[:, 3:].any()
    full = jacobian(lambda flat: flow(flat.view(1, 5, 4), target_mask, memory, src_mask)[0].flatten(),
                    noise.flatten())  # (20, 20)
    assert not full[:12, 12:].any()  # a real output does not depend on a padding input
    assert abs(float(torch.linalg.slogdet(full[:12, :12]).logabsdet) - float(log_det[0].detach())) < 1e-4
    noise_back, _ = flow.inverse(latents, target_mask, memory, src_mask)
    torch.testing.assert_close(noise_back[:, :3], noise[:, :3], rtol=0, atol=1e-5)


def test_padding_columns_leave_the_loss_and_the_outputs_unchanged(trained, copy_task):
    model = trained_flowseq(trained)
    rows = copy_task[2]
    batch = model.training_inputs(select_rows(rows, torch.arange(6)), torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss, metrics = model.loss(batch)
    extra = 3
    padded = dict(batch)
    padded["tgt"] = torch.cat([batch["tgt"], torch.full((6, extra), PAD)], dim=1)
    padded["tgt_mask"] = torch.cat([batch["tgt_mask"], torch.zeros(6, extra, dtype=torch.bool)], dim=1)
    padded["posterior_noise"] = torch.cat([batch["posterior_noise"], torch.randn(6, extra, SMALL["latent_dim"])],
                                          dim=1)
    with torch.no_grad():
        padded_loss, padded_metrics = model.loss(padded)
    assert abs(float(padded_loss) - float(loss)) < 1e-5
    assert padded_metrics == pytest.approx(metrics, abs=1e-5)
    together = model.generate(rows["src"][:8], rows["src_mask"][:8])  # sources and outputs of other lengths
    for row in range(8):
        width = int(rows["src_mask"][row].sum())
        assert model.generate(rows["src"][row:row + 1, :width], rows["src_mask"][row:row + 1, :width]) == \
            [together[row]]


def test_the_loss_is_the_negative_elbo_with_a_brute_force_prior_density(trained, copy_task):
    """One row: −log p(y | z, x) + log q(z | y, x) − log p(z | x) at z = μ + σ·n, the prior's density by the
    change of variables with torch's Jacobian of the flow's inverse, q's by torch.distributions."""
    model = trained_flowseq(trained)
    batch = model.training_inputs(select_rows(copy_task[2], torch.tensor([0])), torch.Generator().manual_seed(2))
    src, src_mask, tgt, tgt_mask = batch["src"], batch["src_mask"], batch["tgt"], batch["tgt_mask"]
    _, metrics = model.loss(batch)
    memory = model.backbone.encode(src, src_mask)
    mean, log_variance = model.posterior_parameters(tgt, tgt_mask, memory, src_mask)
    posterior = torch.distributions.Normal(mean, (0.5 * log_variance).exp())
    latents = mean + posterior.stddev * batch["posterior_noise"]
    shape, tokens = latents.shape, int(tgt_mask.sum())
    to_noise = jacobian(lambda flat: model.prior_flow.inverse(flat.view(shape), tgt_mask, memory, src_mask)[0]
                        .flatten(), latents.detach().flatten())
    noise, _ = model.prior_flow.inverse(latents, tgt_mask, memory, src_mask)
    log_prior = torch.distributions.Normal(0.0, 1.0).log_prob(noise).sum() + torch.linalg.slogdet(to_noise).logabsdet
    kl = posterior.log_prob(latents).sum() - log_prior
    reconstruction = masked_cross_entropy(model.latent_logits(latents, tgt_mask, memory, src_mask), tgt, tgt_mask)
    assert metrics["kl"] == pytest.approx(float(kl.detach()) / tokens, abs=1e-4)
    assert metrics["token_loss"] == pytest.approx(float(reconstruction.detach()), abs=1e-5)


def test_argmax_decoding_is_zero_noise_at_the_predicted_length_and_deterministic(trained, copy_task):
    model = trained_flowseq(trained)
    vocabulary, _, rows, pairs = copy_task
    src, src_mask = rows["src"], rows["src_mask"]
    torch.manual_seed(1)
    outputs = model.generate(src, src_mask)
    torch.manual_seed(2)  # other global draws: argmax decoding takes none
    assert model.generate(src, src_mask) == outputs

    memory = model.backbone.encode(src, src_mask)
    lengths = model.backbone.length_logits(memory, src_mask).argmax(-1) + 1
    target_mask = torch.arange(int(lengths.max())) < lengths.unsqueeze(1)
    latents, _ = model.prior_flow(torch.zeros(*target_mask.shape, SMALL["latent_dim"]), target_mask, memory, src_mask)
    logits = model.latent_logits(latents, target_mask, memory, src_mask)
    logits[..., list(NEVER_GENERATED) + [EOS]] = float("-inf")
    expected = [row[mask].tolist() for row, mask in zip(logits.argmax(-1), target_mask)]
    assert outputs == expected
    texts = [vocabulary.decode(output) for output in outputs]
    assert sacrebleu.corpus_bleu(texts, [[summary for _, summary in pairs]]).score > 60  # the copy task is learnt


def test_length_candidates_and_token_choice():
    assert length_candidates(torch.tensor([5, 1, 12]), 2, max_length=12).tolist() == [[5, 4, 6, 3, 7],
                                                                                       [1, 1, 2, 1, 3],
                                                                                       [12, 11, 12, 10, 12]]
    assert length_candidates(torch.tensor([4]), 0, max_length=12).tolist() == [[4]]
    assert length_mask(torch.tensor([2, 3])).tolist() == [[True, True, False], [True, True, True]]
    logits = torch.zeros(1, 3, 8)
    logits[0, :, EOS] = 5.0  # never chosen: the length is decided
    logits[0, 0, 6], logits[0, 1, 7], logits[0, 2, 5] = 1.0, 1.0, 1.0
    assert fixed_length_tokens(logits, torch.tensor([[True, True, False]])).tolist() == [[6, 7, PAD]]


def test_noisy_parallel_decoding_returns_what_the_scorer_scores_best(trained, copy_task):
    model = trained_flowseq(trained)
    rows = copy_task[2]
    src, src_mask = rows["src"][:4], rows["src_mask"][:4]
    calls = []

    def long_and_varied(src_ids, src_mask, candidates, candidate_mask):  # likes long candidates of many tokens
        calls.append(len(candidates))
        return candidate_mask.sum(dim=1).float() + 0.1 * candidates.sum(dim=1).float() / 1000

    # the copy task's summary is fixed by its source, so the trained decoder leans on the source more than on z:
    # noise of scale 1-2 seldom changes a token there, wide noise does
    samples, window, temperature = 3, 1, 5.0
    result = noisy_parallel_decode(model, src, src_mask, long_and_varied, samples=samples, length_window=window,
                                   temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert calls == [4 * samples * (2 * window + 1)]  # every candidate of every source in one call
    assert result.scores.shape == (4, 9)
    memory = model.backbone.encode(src, src_mask)
    best_lengths = (model.backbone.length_logits(memory, src_mask).argmax(-1) + 1).tolist()
    for row in range(4):
        candidates = result.candidates[row]
        assert candidates[0] == model.generate(src[row:row + 1], src_mask[row:row + 1])[0]
        assert [len(candidate) for candidate in candidates] == \
            [best_lengths[row] + offset for offset in (0, -1, 1) for _ in range(samples)]
        assert result.sequences[row] == max(candidates, key=lambda candidate: (len(candidate), sum(candidate)))
    assert any(len({tuple(c) for c in candidates[:samples]}) > 1 for candidates in result.candidates)  # sampled

    again = noisy_parallel_decode(model, src, src_mask, long_and_varied, samples=samples, length_window=window,
                                  temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert again.candidates == result.candidates
    frozen = noisy_parallel_decode(model, src, src_mask, long_and_varied, samples=samples, temperature=0.0)
    for candidates in frozen.candidates:  # no noise: every sample of a length is its argmax
        assert all(candidates[start:start + samples] == [candidates[start]] * samples for start in (0, 3, 6))


def test_the_ar_student_scores_every_candidate_in_one_batched_pass(trained, seeded, tiny_config, copy_task):
    model, student = trained_flowseq(trained), seeded(ARStudent, tiny_config())
    rows = copy_task[2]
    src, src_mask = rows["src"][:3], rows["src_mask"][:3]
    calls = []

    def scorer(*arguments):
        calls.append(1)
        return student.sequence_log_probs(*arguments)

    result = noisy_parallel_decode(model, src, src_mask, scorer, samples=2, length_window=2, temperature=2.0,
                                   generator=torch.Generator().manual_seed(1))
    assert len(calls) == 1 and result.scores.shape == (3, 10)
    for row in range(3):
        alone = student.sequence_log_probs(src[row:row + 1].expand(10, -1), src_mask[row:row + 1].expand(10, -1),
                                           *pad_sequences(result.candidates[row]))
        torch.testing.assert_close(result.scores[row], alone, rtol=0, atol=1e-4 * float(alone.abs().max()))
        assert result.sequences[row] == result.candidates[row][int(alone.argmax())]


def test_training_draws_its_noise_from_the_generator(seeded, tiny_config, copy_task):
    model = seeded(FlowSeqModel, tiny_config(), **SMALL)
    batch = select_rows(copy_task[1], torch.arange(5))
    first = model.training_inputs(batch, torch.Generator().manual_seed(0))["posterior_noise"]
    assert first.shape == (*batch["tgt"].shape, SMALL["latent_dim"])
    assert torch.equal(model.training_inputs(batch, torch.Generator().manual_seed(0))["posterior_noise"], first)
    assert not torch.equal(model.training_inputs(batch, torch.Generator().manual_seed(1))["posterior_noise"], first)


def test_training_lowers_the_held_out_negative_elbo(seeded, tiny_config, copy_task):
    _, rows, held_out, _ = copy_task
    model = seeded(FlowSeqModel, tiny_config(dropout=0.1), **SMALL)
    shown = []
    result = train_model(model, rows, TrainSettings(steps=30, batch_size=32, learning_rate=3e-3, eval_every=15),
                         held_out=held_out, progress=shown.append)
    steps, losses = zip(*result["held_out"])
    assert steps == (0, 15, 30)
    assert losses[2] < 0.6 * losses[0], losses  # observed: 8.4 -> 2.8
    assert {"token_loss", "kl", "length_loss"} <= set(shown[-1]) and not model.training


def test_a_saved_model_decodes_the_same_after_loading(trained, copy_task, tmp_path):
    model = trained_flowseq(trained)
    rows = copy_task[2]
    src, src_mask = rows["src"][:6], rows["src_mask"][:6]
    loaded = FlowSeqModel.load(model.save(tmp_path / "flowseq"))
    assert loaded.options() == SMALL and not loaded.training
    for name, tensor in model.state_dict().items():  # the flow's permutation and signs are buffers: saved too
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert loaded.generate(src, src_mask) == model.generate(src, src_mask)

    def decode(network):
        return noisy_parallel_decode(network, src, src_mask, lambda *args: args[3].sum(dim=1).float(), samples=3,
                                     generator=torch.Generator().manual_seed(4)).candidates

    assert decode(loaded) == decode(model)
    assert held_out_loss(loaded, rows) == held_out_loss(model, rows)
    with pytest.raises(ValueError, match="not a 'mask-predict' one"):
        CMLMModel.load(tmp_path / "flowseq")


def test_bad_options_and_inputs_raise(seeded, tiny_config, copy_task, tmp_path):
    for options in ({"latent_dim": 3}, {"latent_dim": 0}, {"flow_steps": 0}):
        with pytest.raises(ValueError, match="latent_dim|flow_steps"):
            FlowSeqModel(tiny_config(), **options)
    model = seeded(FlowSeqModel, tiny_config(), **SMALL)
    rows = copy_task[2]
    src, src_mask = rows["src"][:2], rows["src_mask"][:2]
    for options in ({"samples": 0}, {"length_window": -1}, {"temperature": -1.0}, {"temperature": float("nan")}):
        with pytest.raises(ValueError, match="samples|length_window|temperature"):
            noisy_parallel_decode(model, src, src_mask, lambda *args: args[3].sum(dim=1).float(), **options)
    batch = model.training_inputs(select_rows(rows, torch.arange(2)), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="posterior_noise"):
        model.loss({**batch, "posterior_noise": batch["posterior_noise"][..., :4]})
    memory = model.backbone.encode(src, src_mask)
    too_long = torch.ones(2, 14, dtype=torch.bool)
    with pytest.raises(ValueError, match="positions"):
        model.prior_flow(torch.zeros(2, 14, SMALL["latent_dim"]), too_long, memory, src_mask)
    NATModel(tiny_config()).save(tmp_path / "nat")
    with pytest.raises(ValueError, match="not a 'flowseq' one"):
        FlowSeqModel.load(tmp_path / "nat")
