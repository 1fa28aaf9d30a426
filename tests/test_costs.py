"""Measured costs and the draft budget: drafts shrink to nothing where verification costs as much as decoding,
and grow where it is nearly free, whatever the machine (fake r(k) tables for both kinds of CPU)."""

from __future__ import annotations

import pytest
import torch

import accelgen
from accelgen import costs
from accelgen.costs import DraftBudget, best_draft_length, verify_ratios
from accelgen.profile import interpolate

# r(k) measured on an AVX2-only EPYC (1.5B in bf16) and on a CPU with native bf16 matrix units
AVX2 = {1: 1.0, 2: 1.64, 4: 2.8, 8: 5.9, 16: 11.5}
NATIVE_BF16 = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.15, 16: 1.47}
LINEAR = {k: float(k) for k in (1, 2, 4, 8, 16)}
FLAT = {k: 1.0 for k in (1, 2, 4, 8, 16)}


def ratio(table):
    return lambda tokens: interpolate(table, tokens)


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.8, 0.95])
def test_no_draft_pays_when_each_verified_token_costs_a_forward(alpha):
    assert best_draft_length(alpha, 0.0, 16, ratio(LINEAR)) == 0
    assert best_draft_length(alpha, 0.3, 16, ratio(LINEAR)) == 0


def test_long_drafts_when_verification_is_free():
    assert best_draft_length(0.9, 0.0, 16, ratio(FLAT)) == 16  # model-free drafts cost nothing: draft all
    assert best_draft_length(0.8, 0.05, 16, ratio(FLAT)) >= 6


def test_the_cpu_decides_the_draft_length():
    # a draft model at c = 0.3 with α = 0.8: long drafts on bf16-native CPUs, none on an AVX2-only one
    assert best_draft_length(0.8, 0.3, 16, ratio(NATIVE_BF16)) >= 3
    assert best_draft_length(0.8, 0.3, 16, ratio(AVX2)) == 0
    # a free drafter that is right 90% of the time still pays a token or two on AVX2
    assert 1 <= best_draft_length(0.9, 0.0, 16, ratio(AVX2)) <= 3


def test_budget_learns_acceptance_and_probes_when_nothing_pays():
    budget = DraftBudget(AVX2, prior_alpha=0.5)
    limits = []
    for _ in range(16):
        limits.append(budget.limit())
        budget.observe(drafted=limits[-1], accepted=0, draft_seconds=0.0, forward_seconds=0.1)
    assert limits[0] == 0 and limits.count(1) == 2  # plain decoding, with one probing step in PROBE_EVERY
    budget = DraftBudget(AVX2, prior_alpha=0.5)
    for _ in range(40):  # a drafter that is always right: its probes raise α until drafts pay
        drafted = budget.limit()
        budget.observe(drafted=drafted, accepted=drafted, draft_seconds=0.0, forward_seconds=0.1)
    assert budget.limit() >= 2


def test_verify_ratios_are_measured_once_per_machine_and_cached(tmp_path, monkeypatch, tiny_target):
    monkeypatch.setenv("ACCELGEN_CACHE", str(tmp_path))
    calls = []

    def fake_measure(model):
        calls.append(model)
        return dict(LINEAR)

    assert verify_ratios(tiny_target, measure=fake_measure) == LINEAR
    assert verify_ratios(tiny_target, measure=fake_measure) == LINEAR  # from the cache
    assert len(calls) == 1
    path = costs.costs_path(tiny_target)
    assert path.is_file() and not path.with_suffix(".partial").exists()
    assert costs.model_format(tiny_target) in path.name and "fp32" in path.name
    verify_ratios(tiny_target, remeasure=True, measure=fake_measure)
    assert len(calls) == 2


def test_measured_budget_keeps_output_exact_and_decodes_plainly_when_nothing_pays(tmp_path, monkeypatch, tiny_target,
                                                                                tokenizer):
    monkeypatch.setenv("ACCELGEN_CACHE", str(tmp_path))
    verify_ratios(tiny_target, measure=lambda model: dict(LINEAR))  # as if measured on a compute-bound machine
    prompt = [5, 17, 923, 4410, 77, 12, 5, 17, 923]
    plain = accelgen.generate(tiny_target, tokenizer, prompt, max_new_tokens=24)
    budgeted = accelgen.generate(tiny_target, tokenizer, prompt, method="speculative", draft_model=tiny_target,
                                 max_new_tokens=24, draft_budget="measured")
    assert budgeted.token_ids == plain.token_ids
    # nearly every step is plain decoding: only the probing steps draft (one token each)
    assert budgeted.stats["draft_tokens"] <= 24 // costs.PROBE_EVERY + 1
    with pytest.raises(ValueError, match="draft_budget"):
        accelgen.generate(tiny_target, tokenizer, prompt, method="pld", draft_budget="sometimes")


def test_measured_budget_drafts_long_where_verification_is_free(tmp_path, monkeypatch, tiny_target, tokenizer):
    monkeypatch.setenv("ACCELGEN_CACHE", str(tmp_path))
    verify_ratios(tiny_target, measure=lambda model: dict(FLAT))
    prompt = torch.tensor([5, 17, 923, 4410, 77, 12])
    plain = accelgen.generate(tiny_target, tokenizer, prompt, max_new_tokens=24)
    budgeted = accelgen.generate(tiny_target, tokenizer, prompt, method="speculative", draft_model=tiny_target,
                                 max_new_tokens=24, gamma=8, draft_budget="measured")
    assert budgeted.token_ids == plain.token_ids
    assert budgeted.stats["mean_accepted_tokens"] > 3  # the self-draft is always right: drafts stay long
