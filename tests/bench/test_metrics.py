"""Speedup aggregation, τ and acceptance, and the Leviathan et al. formulas."""

from __future__ import annotations

import math

import pytest

from accelgen.bench import metrics


def record(prompt_id, method, seconds, tokens=(1, 2), category="c", **extra):
    return {"prompt_id": prompt_id, "method": method, "category": category, "seconds": seconds,
            "token_ids": list(tokens), "new_tokens": len(tokens), "target_forwards": extra.pop("forwards", len(tokens)),
            "committed_per_step": extra.pop("steps", None), "draft_tokens": None, "accepted_draft_tokens": None,
            "draft_seconds": None, **extra}


def test_speedup_total_and_geomean_and_identical():
    records = [record("p1", "hf-greedy", 2.0), record("p2", "hf-greedy", 4.0),
               record("p1", "fast", 1.0), record("p2", "fast", 4.0, tokens=(1, 3))]
    compared = metrics.compare_with_baseline(records, greedy=True)
    fast = [r for r in compared if r["method"] == "fast"]
    assert [r["speedup"] for r in fast] == [2.0, 1.0]
    assert [r["identical"] for r in fast] == [True, False]
    summary = metrics.summarize(fast)
    assert summary["speedup_total"] == pytest.approx(6 / 5)
    assert summary["speedup_geomean"] == pytest.approx(math.sqrt(2))
    assert summary["identical"] == 1 and summary["compared"] == 2 and summary["mismatched_prompts"] == ["p2"]
    assert [r["agreement"] for r in fast] == [1.0, 0.5] and summary["agreement"] == 0.75
    assert [r["rouge_l"] for r in fast] == [1.0, 0.5] and summary["rouge_l"] == 0.75
    assert summary["mean_layers"] is None and summary["pass_at_1"] is None  # no record carries them
    assert summary["tokens_per_second"] == pytest.approx(4 / 5)


def test_speedup_per_token_counts_a_longer_or_shorter_output():
    records = [record("p1", "hf-greedy", 2.0, tokens=(1, 2)), record("p1", "lossy", 4.0, tokens=(1, 5, 6, 7, 8, 9))]
    lossy = metrics.summarize([r for r in metrics.compare_with_baseline(records, greedy=True) if r["method"] == "lossy"])
    assert lossy["speedup_total"] == 0.5  # twice the time ...
    assert lossy["speedup_per_token"] == pytest.approx(1.5)  # ... for three times the tokens


def test_sampling_runs_are_not_compared_for_identity():
    records = [record("p1", "hf-greedy", 2.0), record("p1", "fast", 1.0, tokens=(9,))]
    compared = metrics.compare_with_baseline(records, greedy=False)
    assert all(r["identical"] is None and r["agreement"] is None for r in compared)
    assert metrics.summarize(compared)["agreement"] is None


def test_aggregate_scopes_and_unknown_quantities():
    records = [record("p1", "hf-greedy", 2.0, category="a"), record("p2", "hf-greedy", 2.0, category="b"),
               record("p1", "spec", 1.0, category="a", forwards=1, draft_tokens=4, accepted_draft_tokens=1),
               record("p2", "spec", 1.0, category="b", forwards=2, draft_tokens=4, accepted_draft_tokens=0)]
    result = metrics.aggregate(metrics.compare_with_baseline(records, True), ["hf-greedy", "spec"])
    assert list(result) == ["overall", "a", "b"]
    assert result["overall"]["spec"]["tau"] == pytest.approx(4 / 3)
    assert result["overall"]["spec"]["acceptance_rate"] == pytest.approx(1 / 8)
    assert result["a"]["spec"]["speedup_total"] == 2.0
    assert result["overall"]["hf-greedy"]["acceptance_rate"] is None  # unknown, not zero


def test_per_token_acceptance_leaves_out_each_last_step():
    # gamma 4: steps commit 5, 3, 1, 5 tokens (the final 2 is dropped): 10 accepted, 2 rejections
    assert metrics.per_token_acceptance([{"committed_per_step": [5, 3, 1, 5, 2]}], gamma=4) == pytest.approx(10 / 12)
    assert metrics.per_token_acceptance([{"committed_per_step": [3]}], gamma=4) is None


def test_theory_check_rows():
    overall = {"speculative": {"acceptance_rate": 0.5, "alpha_per_token": 0.8, "tau": 2.0, "speedup_total": 1.3,
                               "tokens_per_second": 3.0},
               "autoregressive": {"tokens_per_second": 2.0}}
    rows = metrics.theory_check(overall, "speculative", gamma=2, cost_ratio=0.25)
    assert [r["alpha_source"] for r in rows] == ["acceptance rate", "per-token estimate"]
    assert rows[0]["predicted_speedup"] == pytest.approx(1.75 / 1.5)
    assert rows[0]["measured_speedup_vs_autoregressive"] == pytest.approx(1.5)
    assert metrics.theory_check(overall, "speculative", 2, cost_ratio=None) == []


def test_early_exit_depth_and_test_outcomes_are_averaged_where_known():
    records = [{**record("p1", "exit", 1.0), "mean_layers": 20.0, "passed": True},
               {**record("p2", "exit", 1.0), "mean_layers": 24.0, "passed": False},
               {**record("p3", "exit", 1.0), "mean_layers": None, "passed": None}]
    summary = metrics.summarize(metrics.compare_with_baseline(records, greedy=True))
    assert summary["mean_layers"] == 22.0 and summary["pass_at_1"] == 0.5


def test_rows_in_another_weight_format_compare_with_that_formats_autoregressive_row():
    """A quantized row's output is compared with the autoregressive row of its format, not with hf-greedy (another
    model); its speed with hf-greedy and, in the same format, with that autoregressive row."""
    records = [record("p1", "hf-greedy", 4.0, tokens=(1, 2, 3), weights="bf16", reference="hf-greedy"),
               record("p1", "autoregressive@weights=int8", 2.0, tokens=(1, 9, 9), weights="int8",
                      reference="hf-greedy", speed_reference="autoregressive@weights=int8"),
               record("p1", "pld@weights=int8", 1.0, tokens=(1, 9, 9), weights="int8",
                      reference="autoregressive@weights=int8", speed_reference="autoregressive@weights=int8"),
               record("p1", "llamacpp-ngram", 0.5, tokens=(1, 9, 8), weights="gguf", reference="llamacpp"),
               record("p1", "llamacpp", 0.8, tokens=(1, 9, 8), weights="gguf", reference="llamacpp")]
    compared = {r["method"]: r for r in metrics.compare_with_baseline(records, greedy=True)}
    pld = compared["pld@weights=int8"]
    assert pld["identical"] is True and pld["speedup"] == 4.0 and pld["format_speedup"] == 2.0
    assert compared["llamacpp-ngram"]["identical"] is True and compared["llamacpp-ngram"]["format_speedup"] is None
    summary = metrics.aggregate(list(compared.values()), list(compared))["overall"]
    assert summary["pld@weights=int8"]["format_speedup_total"] == 2.0
    assert summary["pld@weights=int8"]["weights"] == "int8"
    assert summary["llamacpp"]["tokens_per_second"] == pytest.approx(3 / 0.8)
    old = [record("p1", "hf-greedy", 2.0), record("p1", "pld", 1.0)]  # recorded before formats: vs hf-greedy
    assert metrics.compare_with_baseline(old, greedy=True)[1]["identical"] is True
