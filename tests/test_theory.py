import pytest

from accelgen.theory import AcceptanceEstimate, best_gamma, expected_tokens_per_forward, predicted_speedup


def test_leviathan_formulas():
    assert expected_tokens_per_forward(0.0, 5) == 1.0
    assert expected_tokens_per_forward(1.0, 5) == 6.0
    assert expected_tokens_per_forward(0.5, 2) == pytest.approx(1.75)
    assert predicted_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)


def test_best_gamma_maximises_the_predicted_speedup():
    assert best_gamma(0.0, 0.1, 16) == 1  # nothing is accepted: draft as little as possible
    assert best_gamma(1.0, 0.0, 16) == 16  # free drafts, all accepted: as many as allowed
    # α 0.8, c 0.05: S(γ) = (1 − 0.8^(γ+1)) / 0.2 / (0.05γ + 1) peaks at γ = 8 (4.33 / 1.40 = 3.09)
    assert best_gamma(0.8, 0.05, 16) == 8
    assert predicted_speedup(0.8, 8, 0.05) == pytest.approx(3.092, abs=1e-3)
    assert best_gamma(0.8, 0.05, 5) == 5  # capped
    gammas = [best_gamma(alpha, 0.1, 32) for alpha in (0.3, 0.5, 0.7, 0.9)]
    assert gammas == sorted(gammas) and gammas[0] < gammas[-1]  # better drafts are worth drafting further


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
