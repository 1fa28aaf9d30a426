"""NAT-CRF: the forward algorithm, path scores and Viterbi agree with brute force over every sequence; the
beam-approximated likelihood is the exact CRF's when the beam holds the whole vocabulary (and an upper bound of
it otherwise); the low-rank (and dynamic) transitions are E1 (D_i) E2^T; a trained model decodes the best path
of its beam lattice, which scores at least the per-position argmax; training lowers the held-out loss; a saved
model decodes the same after loading."""

from __future__ import annotations

import itertools

import pytest
import torch

from accelgen.nar.backbone import length_loss, masked_cross_entropy
from accelgen.nar.crf import (CRFModel, beam_candidates, beam_log_likelihood, beam_viterbi, crf_log_partition,
                              low_rank_transitions, path_score, viterbi)
from accelgen.nar.nat import NATModel, noisy_parallel_decode, uniform_fertilities
from accelgen.nar.tokens import EOS, NEVER_GENERATED
from accelgen.nar.train import TrainSettings, train_model

TRAINED = dict(rank=8, beam=8, dynamic=True)  # the one trained model most tests share (60 steps)


def brute_force(emissions: torch.Tensor, transitions: torch.Tensor, length: int) -> dict[tuple, float]:
    """The score of every sequence of one row's first `length` positions, summed term by term in Python:
    emissions (L, k), transitions (L-1, k, k)."""
    candidates = emissions.shape[1]
    return {sequence: sum(float(emissions[i, sequence[i]]) for i in range(length))
            + sum(float(transitions[i - 1, sequence[i - 1], sequence[i]]) for i in range(1, length))
            for sequence in itertools.product(range(candidates), repeat=length)}


def random_lattice(seed: int, lengths: list[int], candidates: int = 4, width: int = 4):
    generator = torch.Generator().manual_seed(seed)
    emissions = torch.randn(len(lengths), width, candidates, generator=generator) * 2
    transitions = torch.randn(len(lengths), width - 1, candidates, candidates, generator=generator) * 2
    mask = torch.arange(width) < torch.tensor(lengths).unsqueeze(1)
    return emissions, transitions, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_viterbi_forward_and_path_scores_equal_brute_force_over_every_sequence(seed):
    lengths = [4, 2, 1, 3]  # padding rows: their padded positions must not count
    emissions, transitions, mask = random_lattice(seed, lengths)
    best_paths, best_scores = viterbi(emissions, transitions, mask)
    log_partition = crf_log_partition(emissions, transitions, mask)
    for row, length in enumerate(lengths):
        scores = brute_force(emissions[row], transitions[row], length)
        best = max(scores, key=scores.get)
        assert best_paths[row].tolist() == list(best) + [0] * (4 - length)
        assert float(best_scores[row]) == pytest.approx(scores[best], abs=1e-5)
        assert float(log_partition[row]) == pytest.approx(float(torch.tensor(list(scores.values()))
                                                                .double().logsumexp(0)), abs=1e-5)
    paths = torch.randint(0, 4, (4, 4), generator=torch.Generator().manual_seed(seed))  # any values at padding
    for row, score in enumerate(path_score(emissions, transitions, paths, mask).tolist()):
        length = lengths[row]
        assert score == pytest.approx(brute_force(emissions[row], transitions[row], length)
                                      [tuple(paths[row, :length].tolist())], abs=1e-5)


def test_the_low_rank_transitions_are_e1_times_e2_transposed_or_e1_d_e2_with_the_dynamic_matrix():
    generator = torch.Generator().manual_seed(0)
    previous_embedding, next_embedding = torch.randn(7, 3, generator=generator), torch.randn(7, 3, generator=generator)
    candidates = torch.tensor([[[1, 4], [0, 6], [2, 2]]])  # (1, 3 positions, 2 candidates)
    dynamic = torch.randn(1, 2, 3, 3, generator=generator)
    static, moving = (low_rank_transitions(candidates, previous_embedding, next_embedding, matrices)
                      for matrices in (None, dynamic))
    assert static.shape == moving.shape == (1, 2, 2, 2)
    for position, a, c in itertools.product(range(2), range(2), range(2)):
        before, after = candidates[0, position, a], candidates[0, position + 1, c]
        assert float(static[0, position, a, c]) == pytest.approx(float(previous_embedding[before] @
                                                                       next_embedding[after]), abs=1e-5)
        assert float(moving[0, position, a, c]) == pytest.approx(
            float(previous_embedding[before] @ dynamic[0, position] @ next_embedding[after]), abs=1e-5)


def test_the_beam_holds_the_top_k_tokens_and_in_training_the_gold_one():
    emissions = torch.tensor([[[0.1, 0.9, 0.5, 0.3], [2.0, -1.0, 0.0, 1.0]]])
    assert beam_candidates(emissions, 2).tolist() == [[[1, 2], [0, 3]]]
    assert beam_candidates(emissions, 2, targets=torch.tensor([[0, 3]])).tolist() == [[[0, 1], [3, 0]]]
    assert sorted(beam_candidates(emissions, 4)[0, 0].tolist()) == [0, 1, 2, 3]


def exact_log_likelihood(emissions, targets, length, previous_embedding, next_embedding):
    """log p(targets) of the full CRF of one row by brute force: every |V|^length sequence."""
    transitions = previous_embedding @ next_embedding.T  # (V, V)
    scores = brute_force(emissions[:length], transitions.expand(length - 1, -1, -1), length)
    return scores[tuple(targets[:length].tolist())] - float(torch.tensor(list(scores.values())).double()
                                                            .logsumexp(0))


def test_a_beam_of_the_whole_vocabulary_is_the_exact_crf_and_a_smaller_one_bounds_it():
    generator = torch.Generator().manual_seed(3)
    vocabulary, lengths = 4, [4, 3, 1]
    emissions = torch.randn(3, 4, vocabulary, generator=generator) * 2
    previous_embedding, next_embedding = (torch.randn(vocabulary, 2, generator=generator) for _ in range(2))
    targets = torch.randint(0, vocabulary, (3, 4), generator=generator)
    mask = torch.arange(4) < torch.tensor(lengths).unsqueeze(1)
    full = beam_log_likelihood(emissions, targets, mask, previous_embedding, next_embedding, beam=vocabulary)
    narrow = beam_log_likelihood(emissions, targets, mask, previous_embedding, next_embedding, beam=2)
    for row, length in enumerate(lengths):
        exact = exact_log_likelihood(emissions[row], targets[row], length, previous_embedding, next_embedding)
        assert float(full[row]) == pytest.approx(exact, abs=1e-5)
        assert exact - 1e-5 <= float(narrow[row]) <= 1e-6  # fewer paths in Z, the gold one always among them
    assert float(narrow[0]) > float(full[0]) + 1e-3  # and 2 of 4 tokens do leave paths out
    transitions = previous_embedding @ next_embedding.T
    for row, length in enumerate(lengths):  # Z over the paths of each position's gold token and best other one
        allowed = []
        for position in range(length):
            gold = int(targets[row, position])
            others = [token for token in emissions[row, position].argsort(descending=True).tolist() if token != gold]
            allowed.append([gold, others[0]])
        scores = [sum(float(emissions[row, i, sequence[i]]) for i in range(length))
                  + sum(float(transitions[sequence[i - 1], sequence[i]]) for i in range(1, length))
                  for sequence in itertools.product(*allowed)]
        assert float(narrow[row]) == pytest.approx(scores[0] - float(torch.tensor(scores).double().logsumexp(0)),
                                                   abs=1e-5)  # scores[0]: the all-gold sequence


def full_vocabulary_transitions(model: CRFModel, hidden: torch.Tensor) -> torch.Tensor:
    """(B, T-1, V, V): every transition M_i = E1 (D_i) E2^T of the full vocabulary."""
    everything = torch.arange(model.config.vocab_size).expand(hidden.shape[0], hidden.shape[1], -1)
    return low_rank_transitions(everything, model.previous_embedding, model.next_embedding,
                                model.dynamic_matrices(hidden))


def model_pass(model: CRFModel, rows: dict, count: int):
    src, src_mask, tgt, tgt_mask = (rows[name][:count] for name in ("src", "src_mask", "tgt", "tgt_mask"))
    width = int(tgt_mask.sum(dim=1).max())
    tgt, tgt_mask = tgt[:, :width], tgt_mask[:, :width]
    memory = model.backbone.encode(src, src_mask)
    fertility = uniform_fertilities(src_mask.sum(dim=1), tgt_mask.sum(dim=1), src.shape[1])
    hidden, _ = model.parallel_hidden(src, src_mask, memory, fertility, width)
    return hidden, model.backbone.logits(hidden), tgt, tgt_mask, memory


def test_the_trained_model_with_a_full_beam_scores_and_decodes_as_the_exact_crf(trained, copy_task):
    model = trained(CRFModel, 60, **TRAINED)
    with torch.no_grad():
        hidden, emissions, tgt, tgt_mask, _ = model_pass(model, copy_task[2], 6)
        transitions = full_vocabulary_transitions(model, hidden)
        vocabulary = model.config.vocab_size
        exact = path_score(emissions, transitions, tgt, tgt_mask) - crf_log_partition(emissions, transitions, tgt_mask)
        full = beam_log_likelihood(emissions, tgt, tgt_mask, model.previous_embedding, model.next_embedding,
                                   vocabulary, model.dynamic_matrices(hidden))
        torch.testing.assert_close(full, exact, rtol=0, atol=1e-4)
        narrow = beam_log_likelihood(emissions, tgt, tgt_mask, model.previous_embedding, model.next_embedding,
                                     model.beam, model.dynamic_matrices(hidden))
        assert (narrow >= exact - 1e-4).all() and (exact < -1e-3).any()
        emissions[..., list(NEVER_GENERATED) + [EOS]] = float("-inf")
        tokens, scores = beam_viterbi(emissions, tgt_mask, model.previous_embedding, model.next_embedding, vocabulary,
                                      model.dynamic_matrices(hidden))
        best, best_scores = viterbi(emissions, transitions, tgt_mask)  # the lattice of every token, in id order
        assert torch.equal(tokens, best)
        torch.testing.assert_close(scores, best_scores)


def test_decoding_finds_the_best_path_of_the_beam_lattice_and_beats_the_argmax(trained, copy_task):
    """Brute force over all k^L paths of each row's lattice (the predicted length, the top-k tokens of each
    position); the per-position argmax is one of those paths, so its CRF score can be no higher."""
    model = trained(CRFModel, 60, **TRAINED)
    rows = copy_task[2]
    src, src_mask = rows["src"][:12], rows["src_mask"][:12]
    outputs, argmaxes = model.generate(src, src_mask), model.generate(src, src_mask, decoding="argmax")
    with torch.no_grad():
        memory = model.backbone.encode(src, src_mask)
        fertility = model.fertility_candidates(memory, src_mask)[:, 0]
        hidden, target_mask = model.parallel_hidden(src, src_mask, memory, fertility,
                                                    int(fertility.sum(dim=1).max()))
        emissions = model.backbone.logits(hidden)
        emissions[..., list(NEVER_GENERATED) + [EOS]] = float("-inf")
        candidates = emissions.topk(model.beam, dim=2).indices
        transitions = low_rank_transitions(candidates, model.previous_embedding, model.next_embedding,
                                           model.dynamic_matrices(hidden))
    lattice_emissions = emissions.gather(2, candidates)
    checked, better = 0, 0
    for row, output in enumerate(outputs):
        length = len(output)
        assert length == int(target_mask[row].sum()) and length == len(argmaxes[row])
        if length > 5:
            continue  # 8^6 paths: fewer rows suffice
        paths = torch.tensor(list(itertools.product(range(model.beam), repeat=length)))  # (k^L, L)
        steps = torch.arange(length)
        scores = lattice_emissions[row, steps, paths].sum(dim=1) + \
            transitions[row, steps[:-1], paths[:, :-1], paths[:, 1:]].sum(dim=1)
        best = paths[scores.argmax()]
        assert output == candidates[row, steps, best].tolist()

        def score_of(tokens):
            places = (candidates[row, steps] == torch.tensor(tokens).unsqueeze(1)).int().argmax(dim=1)
            return float(scores[(paths == places).all(dim=1)][0])

        assert score_of(argmaxes[row]) <= score_of(output) + 1e-5
        checked, better = checked + 1, better + (output != argmaxes[row])
    assert checked >= 6 and better >= 1  # the transitions do change some outputs


@torch.no_grad()
def test_the_loss_is_the_crf_nll_per_token_plus_the_length_loss_and_starts_as_the_plain_nat(seeded, tiny_config,
                                                                                              copy_task):
    rows = copy_task[2]
    batch = {name: rows[name][:8] for name in ("src", "src_mask", "tgt", "tgt_mask")}
    for weight in (0.0, 0.5):
        model = seeded(CRFModel, tiny_config(), rank=4, beam=5, token_loss_weight=weight)
        # as if trained: transitions not zero, so that the CRF differs from the plain NAT
        model.next_embedding.normal_(generator=torch.Generator().manual_seed(0))
        loss, metrics = model.loss(batch)
        hidden, emissions, tgt, tgt_mask, memory = model_pass(model, batch, 8)
        crf = -(beam_log_likelihood(emissions, tgt, tgt_mask, model.previous_embedding, model.next_embedding, 5)
                / tgt_mask.sum(dim=1)).mean()
        expected = crf + length_loss(model.backbone, memory, batch["src_mask"], tgt_mask) + \
            weight * masked_cross_entropy(emissions, tgt, tgt_mask)
        assert float(loss) == pytest.approx(float(expected), rel=1e-5)
        assert metrics["crf_loss"] == pytest.approx(float(crf), rel=1e-5) and ("token_loss" in metrics) == bool(weight)
    # untrained: every transition is 0, so the full CRF is the NAT's independent softmax at each position
    model = seeded(CRFModel, tiny_config(), rank=4)  # beam 64, wider than the 35 tokens: the exact CRF
    _, metrics = model.loss(batch)
    _, emissions, tgt, tgt_mask, _ = model_pass(model, batch, 8)
    independent = (emissions.log_softmax(-1).gather(2, tgt.unsqueeze(2)).squeeze(2) * tgt_mask).sum(dim=1)
    assert metrics["crf_loss"] == pytest.approx(float(-(independent / tgt_mask.sum(dim=1)).mean()), rel=1e-5)


@pytest.mark.parametrize("options", [dict(rank=8, beam=8), dict(rank=8, beam=8, dynamic=True, token_loss_weight=0.5)],
                         ids=["crf", "dcrf+token-loss"])
def test_training_lowers_the_held_out_loss(options, seeded, tiny_config, copy_task):
    _, rows, held_out, _ = copy_task
    model = seeded(CRFModel, tiny_config(dropout=0.1), **options)
    result = train_model(model, rows, TrainSettings(steps=30, batch_size=32, learning_rate=3e-3, eval_every=15),
                         held_out=held_out)
    steps, losses = zip(*result["held_out"])
    assert steps == (0, 15, 30)
    assert losses[2] < 0.6 * losses[0], losses  # observed: about 0.33 of the first


def test_a_saved_model_loads_with_its_options_and_decodes_the_same(trained, copy_task, tmp_path):
    model = trained(CRFModel, 60, **TRAINED)
    rows = copy_task[2]
    loaded = CRFModel.load(model.save(tmp_path / "model"))
    assert loaded.options() == model.options() == {"rank": 8, "beam": 8, "dynamic": True, "token_loss_weight": 0.0}
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    for decoding in ("viterbi", "argmax"):
        assert loaded.generate(rows["src"], rows["src_mask"], decoding) == \
            model.generate(rows["src"], rows["src_mask"], decoding)
    with pytest.raises(ValueError, match="not a 'nat' one"):
        NATModel.load(tmp_path / "model")


def test_noisy_parallel_decoding_rescoring_runs_the_crf_on_every_length_candidate(trained, copy_task):
    model = trained(CRFModel, 60, **TRAINED)
    rows = copy_task[2]
    src, src_mask = rows["src"][:4], rows["src_mask"][:4]

    def shortest_first(src_ids, src_mask, candidates, candidate_mask):
        return -candidate_mask.sum(dim=1).float()

    result = noisy_parallel_decode(model, src, src_mask, shortest_first, samples=5,
                                   generator=torch.Generator().manual_seed(0))
    assert [candidates[0] for candidates in result.candidates] == model.generate(src, src_mask)
    memory = model.backbone.encode(src, src_mask)
    for row, candidates in enumerate(result.candidates):
        for candidate in candidates:  # each is the Viterbi decoding at its own length
            lengths = torch.tensor([len(candidate)])
            fertility = uniform_fertilities(src_mask[row:row + 1].sum(dim=1), lengths, src.shape[1])
            tokens, mask = model.decode_fertilities(src[row:row + 1], src_mask[row:row + 1], memory[row:row + 1],
                                                    fertility)
            assert tokens[mask].tolist() == candidate
        assert result.sequences[row] == min(candidates, key=len)


def test_decoding_never_emits_specials_or_eos_even_untrained(seeded, tiny_config, copy_task):
    model = seeded(CRFModel, tiny_config(), rank=4, beam=40)  # wider than the 35 tokens: specials in the lattice
    with torch.no_grad():  # as if trained: transitions that favour the specials
        model.next_embedding.normal_(generator=torch.Generator().manual_seed(0))
        model.next_embedding[list(NEVER_GENERATED) + [EOS]] += 5 * model.previous_embedding.mean(dim=0)
    rows = copy_task[2]
    outputs = model.generate(rows["src"], rows["src_mask"])
    assert all(output and not set(output) & {*NEVER_GENERATED, EOS} for output in outputs)


def test_bad_options_and_inputs_raise_value_errors(tiny_config, seeded, copy_task):
    config = tiny_config()
    for options, message in [(dict(rank=0), "rank"), (dict(beam=0), "beam"), (dict(beam=-3), "beam"),
                             (dict(token_loss_weight=-0.1), "token_loss_weight"),
                             (dict(token_loss_weight=float("nan")), "token_loss_weight")]:
        with pytest.raises(ValueError, match=message):
            CRFModel(config, **options)
    rows = copy_task[2]
    with pytest.raises(ValueError, match="decoding must be one of"):
        seeded(CRFModel, config, rank=4, beam=4).generate(rows["src"][:2], rows["src_mask"][:2], decoding="beam")
    emissions, transitions, mask = random_lattice(0, [3, 2])
    with pytest.raises(ValueError, match="right-padded"):
        viterbi(emissions, transitions, torch.tensor([[True, False, True, False], [True] * 4]))
    with pytest.raises(ValueError, match="at least one real position"):
        crf_log_partition(emissions, transitions, torch.tensor([[False] * 4, [True] * 4]))
    with pytest.raises(ValueError, match="need transitions"):
        path_score(emissions, transitions[:, :2], torch.zeros(2, 4, dtype=torch.long), mask)
    with pytest.raises(ValueError, match="beam must be in"):
        beam_candidates(emissions, 5)
