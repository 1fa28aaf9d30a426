import pytest
import torch

from accelgen.sampling import SamplingConfig, logits_to_probs


def test_temperature_one_is_softmax():
    logits = torch.tensor([1.0, 2.0, 3.0])
    torch.testing.assert_close(logits_to_probs(logits, SamplingConfig(temperature=1.0)), torch.softmax(logits, -1))


def test_top_k_keeps_k_best():
    probs = logits_to_probs(torch.tensor([1.0, 4.0, 3.0, 2.0]), SamplingConfig(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [False, True, True, False]
    assert float(probs.sum()) == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # the best token always survives, however small top_p is
    assert logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.01)).tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingConfig(**bad)


# --- scores as transformers reports them, seeded per-position noise -------------------------------------------


def test_sampling_scores_equal_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from accelgen.sampling import sampling_scores

    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(0)) * 3
    config = SamplingConfig(temperature=0.7, top_k=12, top_p=0.8)
    expected = logits.clone()
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(12), TopPLogitsWarper(0.8)):
        expected = warper(None, expected)
    torch.testing.assert_close(sampling_scores(logits, config), expected)
    assert torch.equal(sampling_scores(logits, SamplingConfig()), logits)  # greedy: the logits themselves


def test_position_noise_depends_on_seed_and_position_only():
    from accelgen.sampling import PositionNoise

    noise = PositionNoise(seed=3, vocab_size=1000)
    again = PositionNoise(seed=3, vocab_size=1000)
    assert torch.equal(noise.at(7), again.at(7))
    assert torch.equal(noise.rows([7, 2]), torch.stack([again.at(7), again.at(2)]))
    assert not torch.equal(noise.at(7), noise.at(8))
    assert not torch.equal(noise.at(7), PositionNoise(seed=4, vocab_size=1000).at(7))
    assert torch.isfinite(noise.at(7)).all() and noise.at(7).dtype == torch.float32
    assert abs(float(noise.at(7).mean()) - 0.5772) < 0.1  # the Gumbel(0, 1) mean is the Euler-Mascheroni constant


def test_gumbel_choice_never_picks_an_excluded_token():
    from accelgen.sampling import PositionNoise, gumbel_choice

    probs = logits_to_probs(torch.randn(1, 50), SamplingConfig(temperature=1.0, top_k=3))
    chosen = {int(gumbel_choice(probs, PositionNoise(seed, 50).rows([0]))[0]) for seed in range(200)}
    assert chosen == set(probs[0].nonzero()[:, 0].tolist())


# --- draws on the device of the probabilities -------------------------------------------------------------------


def test_draw_is_multinomials_own_draw_left_on_the_device():
    """draw() is torch.multinomial's one-sample method without its validity check (a read of the probabilities):
    the same tokens from the same generator state, as a tensor rather than a number read back."""
    from accelgen.sampling import draw

    probs = torch.softmax(torch.randn(6, 300, generator=torch.Generator().manual_seed(0)), dim=-1)
    drawn = draw(probs, torch.Generator().manual_seed(1))
    expected = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(1))[:, 0]
    assert drawn.dtype == torch.long and drawn.shape == (6,) and torch.equal(drawn, expected)
    unnormalised = draw(probs * 7.0, torch.Generator().manual_seed(1))  # each row's scale does not matter
    assert torch.equal(unnormalised, expected)


def test_draw_never_picks_an_excluded_token():
    from accelgen.sampling import draw

    probs = logits_to_probs(torch.randn(1, 50), SamplingConfig(temperature=1.0, top_k=3)).expand(500, -1)
    assert set(draw(probs, torch.Generator().manual_seed(0)).tolist()) == set(probs[0].nonzero()[:, 0].tolist())


def test_position_noise_is_drawn_in_the_probabilities_dtype():
    from accelgen.sampling import PositionNoise

    noise = PositionNoise(seed=3, vocab_size=100)
    assert noise.at(7, like=torch.zeros(1, dtype=torch.float64)).dtype == torch.float64
    assert noise.at(7, like=torch.zeros(1, dtype=torch.float16)).dtype == torch.float32  # never coarser
    assert torch.equal(noise.rows([7, 8], like=torch.zeros(1)), torch.stack([noise.at(7), noise.at(8)]))
