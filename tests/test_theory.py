import pytest

from accelgen.theory import AcceptanceEstimate, best_gamma, expected_tokens_per_forward, predicted_speedup


def test_leviathan_formulas():
    assert expected_tokens_per_forward(0.0, 5) == 1.0
    assert expected_tokens_per_forward(1.0, 5) == 6.0
    assert expected_tokens_per_forward(0.5, 2) == pytest.approx(1.75)
    assert predicted_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)


def test_best_gamma_maximises_the_predicted_speedup():
    assert best_gamma(0.0, 0.1, 16) == 0  # nothing is accepted: no draft (plain decoding, speedup 1)
    assert best_gamma(1.0, 0.0, 16) == 16  # free drafts, all accepted: as many as allowed
    # α 0.8, c 0.05: S(γ) = (1 − 0.8^(γ+1)) / 0.2 / (0.05γ + 1) peaks at γ = 8 (4.33 / 1.40 = 3.09)
    assert best_gamma(0.8, 0.05, 16) == 8
    assert predicted_speedup(0.8, 8, 0.05) == pytest.approx(3.092, abs=1e-3)
    assert best_gamma(0.8, 0.05, 5) == 5  # capped
    gammas = [best_gamma(alpha, 0.1, 32) for alpha in (0.3, 0.5, 0.7, 0.9)]
    assert gammas == sorted(gammas) and gammas[0] < gammas[-1]  # better drafts are worth drafting further


def test_best_gamma_is_zero_when_no_draft_length_pays():
    linear = lambda tokens: float(tokens)  # noqa: E731  every verified token costs a whole forward
    assert [best_gamma(alpha, 0.0, 16, linear) for alpha in (0.3, 0.6, 0.9, 0.99)] == [0, 0, 0, 0]
    assert best_gamma(0.9, 0.0, 16, lambda tokens: 1.0) == 16  # free verification, free drafts: all of them
    # γ = 1 at α 0.6, r(2) 1.5: S = 1.6 / 1.5 ≈ 1.067; it clears a 5% margin, not a 10% one
    assert best_gamma(0.6, 0.0, 1, lambda tokens: 1.5, min_gain=1.05) == 1
    assert best_gamma(0.6, 0.0, 1, lambda tokens: 1.5, min_gain=1.10) == 0
    assert predicted_speedup(0.6, 0, 0.3, 1.0) == 1.0  # γ = 0 is plain decoding by definition
    assert best_gamma(0.9, 0.0, 0) == 0


def test_acceptance_prior():
    assert AcceptanceEstimate.starting_at(0.6).alpha == pytest.approx(0.6)
    prior = AcceptanceEstimate.starting_at(0.6, weight=2.0)
    assert prior.accepted + prior.rejections == pytest.approx(2.0)  # worth two steps
    prior.observe(drafted=1, accepted=0)
    assert prior.alpha < 0.6


def test_acceptance_estimate_counts_runs_of_acceptances_ended_by_a_rejection():
    estimate = AcceptanceEstimate()
    assert estimate.alpha == 0.5  # nothing seen yet
    estimate.observe(drafted=4, accepted=4)  # all accepted: no rejection
    assert estimate.accepted == 4 and estimate.rejections == 0 and estimate.alpha == 5 / 6
    estimate.observe(drafted=4, accepted=1)  # stopped short
    assert estimate.rejections == 1 and estimate.accepted == pytest.approx(0.9 * 4 + 1)
    nothing = AcceptanceEstimate()
    for _ in range(30):
        nothing.observe(drafted=0, accepted=0)  # a drafter that never finds a draft gains nothing
    assert nothing.alpha < 0.1
