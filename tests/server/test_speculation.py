"""The speculation policies: the goodput choice of draft length, its measured costs and acceptance."""

import copy
from types import SimpleNamespace

import pytest
import torch

from accelgen.costs import SIZES, probe_interval
from accelgen.profile import interpolate
from accelgen.server.speculation import (ForwardCosts, Goodput, TokenBudget, best_draft_length, calibrate,
                                        policy_calibration)

AVX2 = {1: 1.0, 2: 1.64, 4: 2.8, 8: 5.9, 16: 11.5}  # r(k) of the 1.5B in bf16 on an AVX2-only EPYC
NATIVE_BF16 = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.15, 16: 1.47}  # ... and on a CPU with native bf16 matrix units


def linear(per_row: float, fixed: float = 0.0):
    return lambda batch, width: fixed + per_row * batch * width


def test_draft_length_follows_the_cost_of_verification():
    flat = lambda batch, width: 1.0  # noqa: E731 - verification free at any width
    assert best_draft_length([0.9, 0.9], 0, flat, None, 8) == 8
    assert best_draft_length([0.0, 0.0], 0, flat, None, 8) == 0  # nothing accepted: shortest on ties
    # every row costs as much as a whole forward: extra rows never pay, even for perfect drafts
    assert best_draft_length([0.99] * 4, 0, linear(1.0), None, 8) == 0
    # a weight-bound forward: t = 1 + 0.02 · rows; a batch of 8 pays 0.16 per extra token each, a batch of 1 0.02
    alone = best_draft_length([0.8], 0, linear(0.02, 1.0), None, 16)
    full = best_draft_length([0.8] * 8, 0, linear(0.02, 1.0), None, 16)
    crowded = best_draft_length([0.8] * 32, 0, linear(0.02, 1.0), None, 16)
    assert (alone, full, crowded) == (11, 5, 2)  # γ falls as the batch grows (Su et al.)


def test_draft_model_rounds_shorten_drafts():
    flat = lambda batch, width: 1.0  # noqa: E731
    assert best_draft_length([0.8], 0, flat, None, 16) == 16
    # E(0.8, g) / (1 + 0.2 g) peaks at g = 4 (3.36 / 1.8)
    assert best_draft_length([0.8], 1, flat, lambda batch, width: 0.2, 16) == 4
    assert best_draft_length([0.8], 1, flat, lambda batch, width: 5.0, 16) == 0  # a draft round dearer than the target's


def test_forward_costs_interpolate_and_follow_measurements():
    costs = ForwardCosts({1: {1: 0.1, 9: 0.5}, 4: {1: 0.2, 9: 1.0}})
    assert costs(1, 5) == pytest.approx(0.3) and costs(4, 5) == pytest.approx(0.6)
    assert costs(2, 5) == pytest.approx(0.4)  # between the batch sizes measured
    costs.observe(4, 9, 2.0)
    assert costs(4, 9) == pytest.approx(0.8 * 1.0 + 0.2 * 2.0)
    costs.observe(4, 3, 0.5)  # a new width: taken as measured
    assert costs(4, 3) == 0.5
    costs.observe(3, 1, 9.0)  # a batch size never calibrated: read between its neighbours instead
    assert 3 not in costs.seconds
    with pytest.raises(ValueError):
        ForwardCosts({1: {}})


def test_calibration_is_measured_once_per_model_and_machine_then_cached(measured_costs, tiny_target):
    measured = measured_costs({tiny_target: (0.1, AVX2)})
    costs = calibrate(tiny_target, max_batch=3, widths=(1, 4))
    assert sorted(costs.seconds) == [1, 2, 3] and all(sorted(costs.seconds[b]) == [1, 4] for b in (2, 3))
    assert set(costs.seconds[1]) == set(SIZES) | {4}  # batch 1 also serves the requests' own budgets: r(k)
    assert costs(3, 4) == pytest.approx(3 * 0.1 * 2.8)
    assert len(measured) == 3
    calibrate(tiny_target, max_batch=3, widths=(1, 4))  # the next start of the server: from the cache
    assert len(measured) == 3


def test_the_policy_calibration_reports_progress_and_a_restart_reads_the_cache(measured_costs, tiny_target,
                                                                                 make_tiny_model):
    draft = make_tiny_model(layers=1)
    measured = measured_costs({tiny_target: (0.1, AVX2)})
    reports = []
    policy = Goodput(max_draft=4, calibration=policy_calibration(tiny_target, draft, max_batch=4, max_draft=4))
    policy.prepare(reports.append)
    assert reports == [f"timing batched forwards: {i}/6" for i in range(1, 7)]  # batches 1, 2, 4 of two models
    assert policy.target(4, 5) == pytest.approx(4 * 0.1 * interpolate(AVX2, 5)) and policy.draft is not None
    timed = len(measured)
    restarted = Goodput(max_draft=4, calibration=policy_calibration(tiny_target, draft, max_batch=4, max_draft=4))
    restarted.prepare()
    assert len(measured) == timed and restarted.target.seconds == policy.target.seconds  # from the cache
    threads = torch.get_num_threads()
    try:  # the costs hold for one thread count, and one weight format
        torch.set_num_threads(threads + 1)
        calibrate(tiny_target, max_batch=1)
        assert len(measured) == timed + 1
    finally:
        torch.set_num_threads(threads)
    calibrate(copy.deepcopy(tiny_target).to(torch.bfloat16), max_batch=1)
    assert len(measured) == timed + 2


@pytest.mark.parametrize("ratios, expected", [
    ({1: 1.0, 16: 16.0}, 0),  # r(k) = k: no draft ever pays
    (AVX2, 0),  # α 0.5 does not pay for r(2) = 1.64
    (NATIVE_BF16, 3),  # nearly free verification: E(0.5, 3) = 1.875 at r(4) = 1
    ({1: 1.0, 16: 1.0}, 8),  # free verification: the longest draft
])
def test_goodput_on_the_cached_costs_of_each_kind_of_cpu(measured_costs, tiny_target, ratios, expected):
    measured_costs({tiny_target: (0.1, ratios)})
    policy = Goodput(calibrate(tiny_target, max_batch=1), max_draft=8)
    length = policy.draft_length([fake_request("pld")])  # α = 0.5 before anything is verified
    assert length == expected


def fake_request(method: str, with_draft_model: bool = False):
    return SimpleNamespace(method=method, sequence=SimpleNamespace(drafts_with_a_model=with_draft_model))


def test_goodput_learns_acceptance_per_request_and_per_method():
    policy = Goodput(ForwardCosts({1: {1: 1.0, 64: 1.0}}), max_draft=6)
    first = fake_request("pld")
    assert policy.draft_length([first]) == 6  # free verification: draft the most
    for _ in range(20):
        policy.verified(first, drafted=6, accepted=0)
    assert policy.acceptance(first).alpha < 0.1
    policy.left(first)
    assert id(first) not in policy.by_request
    newcomer = fake_request("pld")  # starts from what the method achieved lately
    assert policy.acceptance(newcomer).alpha < 0.1
    assert policy.acceptance(fake_request("speculative")).alpha == 0.5


def test_goodput_probes_while_it_does_not_draft():
    # verification grows slower than its width: well-accepted drafts would pay, so acceptance is kept measured
    policy = Goodput(ForwardCosts({1: {1: 1.0, 2: 1.9, 5: 3.0}}), max_draft=4)
    request = fake_request("speculative", with_draft_model=True)
    for _ in range(20):
        policy.verified(request, drafted=4, accepted=0)  # drafting does not pay at this acceptance
    interval = probe_interval(1.9 / 1.0 - 1)  # a probe costs t(1, 2) / t(1, 1) − 1 steps if rejected
    lengths = [policy.draft_length([request]) for _ in range(2 * interval)]
    assert lengths.count(1) == 2 and lengths.count(0) == 2 * interval - 2


def test_goodput_makes_no_probe_where_no_draft_could_pay():
    policy = Goodput(ForwardCosts({1: {1: 1.0, 2: 2.0}}), max_draft=4)  # verifying k tokens costs k steps
    request = fake_request("speculative", with_draft_model=True)
    assert not policy.could_pay(1, 1)
    assert [policy.draft_length([request]) for _ in range(3 * probe_interval(1.0))] == [0] * 3 * probe_interval(1.0)


def test_goodput_measures_target_and_draft_rounds():
    policy = Goodput(ForwardCosts({4: {1: 1.0, 64: 1.0}}))
    requests = [fake_request("speculative", with_draft_model=True) for _ in range(4)]
    assert policy.draft_length(requests) > 0
    policy.measured(target_batch=4, target_width=2, target_seconds=2.0)
    policy.measured(draft_batch=4, draft_rounds=2, draft_seconds=1.0)  # right after a step without drafts
    assert policy.target.seconds[4][2] == 2.0 and policy.draft is None  # a catch-up round: not measured
    policy.draft_length(requests)
    policy.measured(draft_batch=4, draft_rounds=2, draft_seconds=1.0)
    assert policy.draft(4, 1) == 0.5  # no calibration of the draft model: learnt from what it measures


def test_token_budget_caps_by_batch_size():
    budget = TokenBudget(16)
    assert [budget.draft_length([None] * b) for b in (1, 2, 4, 8, 16, 32)] == [15, 7, 3, 1, 0, 0]
    assert TokenBudget(0).draft_length([None] * 8) is None
    with pytest.raises(ValueError):
        TokenBudget(-1)
