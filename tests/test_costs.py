"""Measured costs and the draft budget: drafts shrink to nothing where verification costs as much as decoding,
and grow where it is nearly free, whatever the machine (fake r(k) tables for both kinds of CPU, no real timing)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

import accelgen
from accelgen import costs, hardware
from accelgen.cli import app
from accelgen.costs import DraftBudget, cached_profile, draft_cost_ratio, forward_seconds, probe_interval, verify_ratios
from accelgen.profile import interpolate
from accelgen.theory import AcceptanceEstimate, best_gamma

# r(k) of the 1.5B in bf16: on an AVX2-only EPYC (measured), and on a CPU with native bf16 matrix units
AVX2 = {1: 1.0, 2: 1.64, 4: 2.8, 8: 5.9, 16: 11.5}
NATIVE_BF16 = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.15, 16: 1.47}
LINEAR = {k: float(k) for k in (1, 2, 4, 8, 16)}  # every verified token costs a whole forward
FLAT = {k: 1.0 for k in (1, 2, 4, 8, 16)}  # verification as cheap as decoding one token

PROMPT = [5, 17, 923, 4410, 77, 12, 5, 17, 923]


def best_length(alpha, cost_ratio, table, max_length=16):
    return best_gamma(alpha, cost_ratio, max_length, lambda tokens: interpolate(table, tokens), costs.MIN_GAIN)


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.8, 0.95])
def test_no_draft_pays_when_each_verified_token_costs_a_forward(alpha):
    assert best_length(alpha, 0.0, LINEAR) == 0
    assert best_length(alpha, 0.3, LINEAR) == 0
    assert DraftBudget(LINEAR, prior_alpha=alpha).limit() == 0


def test_long_drafts_when_verification_is_free():
    assert best_length(0.9, 0.0, FLAT) == 16  # model-free drafts cost nothing: draft all
    assert best_length(0.8, 0.05, FLAT) >= 6
    assert DraftBudget(FLAT).limit() == 16


def test_the_cpu_decides_the_draft_length():
    # a draft model at c = 0.3 with α = 0.8: drafts of several tokens on bf16-native CPUs, none on an AVX2-only one
    assert best_length(0.8, 0.3, NATIVE_BF16) >= 3
    assert best_length(0.8, 0.3, AVX2) == 0
    # a free drafter right 90% of the time: a long draft on bf16-native CPUs, a token or three on AVX2
    assert best_length(0.9, 0.0, NATIVE_BF16) >= 8
    assert 1 <= best_length(0.9, 0.0, AVX2) <= 3
    # at the prior acceptance α = 0.6, a free drafter pays on bf16-native CPUs only
    assert DraftBudget(NATIVE_BF16).limit() >= 4 and DraftBudget(AVX2).limit() == 0


def test_probes_cost_at_most_a_fixed_share_of_decoding():
    assert probe_interval(0.64) == 32  # AVX2, free drafts: a rejected probe costs r(2) − 1 = 0.64 steps
    assert probe_interval(0.94) == 47  # the same with a draft model at c = 0.3
    assert probe_interval(0.0) == 1
    for extra in (0.1, 0.64, 2.0):
        assert extra / probe_interval(extra) <= costs.PROBE_COST


def test_budget_learns_acceptance_and_probes_when_nothing_pays():
    budget = DraftBudget(AVX2)
    interval = probe_interval(AVX2[2] - 1)
    limits = []
    for _ in range(2 * interval):
        limits.append(budget.limit())
        budget.observe(drafted=limits[-1], accepted=0)
    assert limits[0] == 0 and limits.count(1) == 2 and limits[interval - 1] == 1  # plain, with rare probes
    budget = DraftBudget(AVX2)
    for _ in range(3 * interval):  # a drafter that is always right: its probes raise α until drafts pay
        drafted = budget.limit()
        budget.observe(drafted=drafted, accepted=drafted)
    assert budget.limit() >= 2


def test_no_probes_where_even_a_perfect_draft_would_not_pay():
    # llama.cpp's Q4_K 1.5B on a 2-core AVX-512 EPYC (measured): r(2) = 2.4, and a 0.5B draft at c = 0.57
    gguf = {1: 1.0, 2: 2.38, 3: 2.25, 4: 2.89, 6: 4.12, 8: 6.07, 12: 7.83, 16: 8.5}
    with_draft = DraftBudget(gguf, cost_ratio=0.57, max_length=32)
    assert not with_draft.could_pay()  # though r(33) extrapolated from r(12) and r(16) would let 32 tokens pay
    assert [with_draft.limit() for _ in range(10 * probe_interval(0.57 + 2.38 - 1))] == [0] * 10 * probe_interval(1.95)
    model_free = DraftBudget(gguf)  # free drafts of 16 accepted tokens would pay (17 / 8.5): keep probing
    assert model_free.could_pay()
    assert 1 in [model_free.limit() for _ in range(probe_interval(gguf[2] - 1))]
    assert not DraftBudget(LINEAR).could_pay()


def test_budget_follows_the_measured_drafting_cost():
    budget = DraftBudget(NATIVE_BF16, cost_ratio=0.05)
    long = budget.limit()
    for _ in range(20):  # drafting 1 token takes as long as a whole decoding step: no draft pays
        budget.observe(drafted=4, accepted=2, draft_seconds=0.4, step_seconds=0.1)
    assert budget.cost_ratio == pytest.approx(1.0, rel=0.05) and budget.limit() < long
    budget.observe(drafted=0, accepted=0, draft_seconds=9.0, step_seconds=0.1)  # nothing drafted: ignored
    assert budget.cost_ratio == pytest.approx(1.0, rel=0.05)


def test_model_free_drafts_are_taken_to_cost_nothing():
    free = DraftBudget(FLAT, learn_cost=False)
    free.observe(drafted=4, accepted=2, draft_seconds=1.0, step_seconds=0.1)
    assert free.cost_ratio == 0.0 and free.limit() == 16


def test_a_lookahead_window_is_a_fixed_cost_every_draft_must_pay_for():
    # the window's 6 nodes are verified every step without being drafted to be accepted
    native = DraftBudget(NATIVE_BF16, fixed_nodes=6)
    assert native.limit() > 6  # nearly free verification: the window and pooled tokens
    assert DraftBudget(AVX2, fixed_nodes=6).limit() == 0  # r(8) = 5.9: not even one pooled token pays for it
    prior = native.acceptance.rejections
    native.observe(drafted=8, accepted=2)  # both pooled tokens accepted: no rejection
    assert native.acceptance.rejections == pytest.approx(0.9 * prior)
    native.observe(drafted=6, accepted=0)  # the window alone (no pooled n-gram): nothing to learn
    assert native.acceptance.rejections == pytest.approx(0.9 * prior)


def test_costs_are_measured_once_per_model_format_and_machine(measured_costs, tiny_target):
    measured = measured_costs({tiny_target: (0.02, LINEAR)})
    assert verify_ratios(tiny_target) == pytest.approx({k: float(k) for k in costs.SIZES})
    assert verify_ratios(tiny_target) == pytest.approx({k: float(k) for k in costs.SIZES})  # from the cache
    assert len(measured) == 1 and measured[0][2] == list(costs.SIZES)
    path = costs.costs_path(tiny_target)
    saved = json.loads(path.read_text())
    assert saved["format"] == "fp32" and "fp32" in path.name and saved["model"] == costs.model_key(tiny_target)
    assert saved["machine"]["flags"] == hardware.cpu_flags() and hardware.machine_key() in str(path)
    assert not list(path.parent.glob("*.partial"))  # written atomically: a temporary file renamed
    assert forward_seconds(tiny_target, sizes=(1, 32))[32] == pytest.approx(0.64)  # a new size: measured, added
    assert measured[-1][2] == [1, 32] and 32 in verify_ratios(tiny_target)

    bf16 = copy.deepcopy(tiny_target).to(torch.bfloat16)  # another weight format: measured apart
    verify_ratios(bf16)
    assert len(measured) == 3 and costs.costs_path(bf16) != path and "bf16" in costs.costs_path(bf16).name
    verify_ratios(tiny_target, remeasure=True)  # `accelgen profile --remeasure`
    assert len(measured) == 4


def test_another_machine_measures_again(measured_costs, tiny_target, monkeypatch):
    measured = measured_costs({tiny_target: (0.02, AVX2)})
    verify_ratios(tiny_target)
    monkeypatch.setattr(hardware, "machine_key", lambda threads=None: "another-cpu")
    assert verify_ratios(tiny_target)[8] == pytest.approx(5.9)
    assert len(measured) == 2 and "another-cpu" in str(costs.costs_path(tiny_target))


def test_a_gpu_never_reads_the_cpus_timings_nor_the_reverse(measured_costs, tiny_target, monkeypatch):
    measured = measured_costs({tiny_target: (0.02, AVX2)})
    on_cpu = costs.costs_path(tiny_target)
    assert verify_ratios(tiny_target)[8] == pytest.approx(5.9) and len(measured) == 1
    assert json.loads(on_cpu.read_text())["device"] == {"type": "cpu"}
    # the same model on a GPU (as if: the key asks the model's device and the GPU's name)
    monkeypatch.setattr(costs, "model_device", lambda model: torch.device("cuda", 0))
    monkeypatch.setattr(hardware, "device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(hardware, "describe_device", lambda device: {"type": "cuda", "name": "NVIDIA H200"})
    on_gpu = costs.costs_path(tiny_target)
    assert on_gpu != on_cpu and on_gpu.parent.name == "cuda-nvidia-h200" and on_gpu.name == on_cpu.name
    verify_ratios(tiny_target)
    assert len(measured) == 2  # measured on the GPU, not read from the CPU's file
    assert json.loads(on_gpu.read_text())["device"]["name"] == "NVIDIA H200"
    monkeypatch.setattr(hardware, "device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    assert costs.costs_path(tiny_target).parent.name == "cuda-nvidia-a100-sxm4-80gb"  # another GPU, another file


def test_draft_cost_ratio_and_cached_profile(measured_costs, tiny_target, tiny_draft):
    measured_costs({tiny_target: (0.2, NATIVE_BF16), tiny_draft: (0.05, NATIVE_BF16)})
    assert draft_cost_ratio(tiny_target, tiny_draft) == pytest.approx(0.25)
    result = cached_profile(tiny_target, tiny_draft, batch_sizes=(1, 4))
    assert result["verify_ratio"][8] == pytest.approx(1.15) and result["cost_ratio"] == pytest.approx(0.25)
    assert result["batch_seconds"][4][1] == pytest.approx(0.8)  # batches of 4: the fake takes 4× as long


def test_profile_command_shows_the_cached_costs_and_remeasures(measured_costs, smollm):
    model, _ = smollm
    measured = measured_costs({model: (0.03, AVX2)})
    arguments = ["profile", "--model", "smollm2-135m", "--dtype", "float32", "--json"]
    first = CliRunner().invoke(app, arguments)
    assert first.exit_code == 0, first.output
    result = json.loads(first.stdout)
    assert result["verify_ratio"]["8"] == pytest.approx(5.9) and result["cache"].endswith("-fp32.json")
    assert result["model_free_predictions"][0]["best_gamma"] == 0  # α 0.5 on AVX2: no draft pays
    assert len(measured) == 1
    assert CliRunner().invoke(app, arguments + ["--remeasure"]).exit_code == 0 and len(measured) == 2
    both = CliRunner().invoke(app, arguments + ["--remeasure", "--sizes", "1,2"])
    assert both.exit_code != 0 and "--remeasure" in both.output


def test_generation_falls_back_to_plain_decoding_where_nothing_pays(measured_costs, tiny_target, tokenizer):
    measured_costs({tiny_target: (0.01, LINEAR)})  # as if measured on a compute-bound machine
    plain = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=24)
    for method, options in [("pld", {}), ("trie-lookahead", {}), ("lookahead-decoding", {}),
                            ("speculative", {"draft_model": tiny_target, "gamma_schedule": "cost"}),
                            ("specinfer", {"draft_model": tiny_target, "draft_budget": "measured"})]:
        result = accelgen.generate(tiny_target, tokenizer, PROMPT, method=method, max_new_tokens=24, **options)
        assert result.token_ids == plain.token_ids, method
        assert result.stats["draft_tokens"] == 0, method  # 24 steps: not one probe yet
    with pytest.raises(ValueError, match="draft_budget"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="pld", draft_budget="sometimes")


def test_explicit_sizes_are_kept(measured_costs, tiny_target, tokenizer):
    measured_costs({tiny_target: (0.01, LINEAR)})
    plain = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=24)
    for method, options in [("speculative", {"draft_model": tiny_target, "gamma": 4}),  # gamma_schedule="constant"
                            ("lookahead-decoding", {"max_nodes": None})]:
        result = accelgen.generate(tiny_target, tokenizer, PROMPT, method=method, max_new_tokens=24, **options)
        assert result.token_ids == plain.token_ids and result.stats["draft_tokens"] > 0, method
    assert result.stats["draft_tokens"] >= 23 * 4  # every step drafts the whole window and its guesses


def test_drafts_are_long_where_verification_is_free(measured_costs, tiny_target, tokenizer):
    cheap = copy.deepcopy(tiny_target)  # the target's own weights (every draft accepted), timed as a cheap draft model
    cheap.config._name_or_path = "cheap-copy"
    measured_costs({tiny_target: (0.2, FLAT), cheap: (0.01, FLAT)})  # c = 0.05
    plain = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=32)
    speculative = accelgen.generate(tiny_target, tokenizer, PROMPT, method="speculative", draft_model=cheap,
                                    gamma_schedule="cost", max_new_tokens=32)
    assert speculative.token_ids == plain.token_ids
    assert accelgen.generate(tiny_target, tokenizer, PROMPT, method="pld", max_new_tokens=32).token_ids == plain.token_ids
    # the first two steps follow the measured costs and the prior α alone (later ones also this machine's timing):
    # γ = 4 at α = 0.6 and c = 0.05, then longer once all four are accepted
    after_one_step = AcceptanceEstimate.starting_at(costs.PRIOR_ALPHA)
    after_one_step.observe(drafted=4, accepted=4)
    second = best_length(after_one_step.alpha, 0.05, FLAT, 32)
    assert speculative.stats["accepted_per_step"][:2] == [4, second] and second > 4


# the draft methods whose defaults the measured budget caps, down to no draft (MethodSpec.draft_budget)
BUDGETED_BY_DEFAULT = ["speculative", "specinfer", "cascade", "staged", "spectr", "mcsd", "block-verify", "distillspec",
                       "online", "triforce", "self-speculative", "layerskip"]


def test_draft_methods_default_to_plain_decoding_where_nothing_pays(measured_costs, tiny_target, tokenizer):
    measured_costs({tiny_target: (0.01, LINEAR)})  # as if measured on a compute-bound machine
    budgeted = {spec.name for spec in accelgen.list_methods() if spec.draft_budget == "measured"}
    assert set(BUDGETED_BY_DEFAULT) <= budgeted
    plain = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=24)
    # (distillspec: speculative's drafter over a distilled draft, which this tiny target has none of)
    for method in [name for name in BUDGETED_BY_DEFAULT if name != "distillspec"]:
        spec = accelgen.get_method(method)
        draft = {"draft_model": tiny_target} if spec.needs_draft_model else {}
        result = accelgen.generate(tiny_target, tokenizer, PROMPT, method=method, max_new_tokens=24, **draft)
        assert result.token_ids == plain.token_ids, method
        assert result.stats["draft_tokens"] == 0, method  # 24 steps: not one probe yet


def test_draft_methods_default_to_drafts_where_they_pay(measured_costs, tiny_target, tokenizer):
    cheap = copy.deepcopy(tiny_target)  # the target's own weights (every draft accepted), timed as a cheap draft model
    cheap.config._name_or_path = "cheap-copy"
    measured_costs({tiny_target: (0.2, FLAT), cheap: (0.01, FLAT)})  # c = 0.05
    plain = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=24)
    for method in ("speculative", "specinfer", "block-verify"):
        result = accelgen.generate(tiny_target, tokenizer, PROMPT, method=method, draft_model=cheap, max_new_tokens=24)
        assert result.token_ids == plain.token_ids, method
        assert result.stats["accepted_draft_tokens"] > 0, method


def test_a_fixed_length_is_an_explicit_option(measured_costs, tiny_target, tokenizer):
    measured_costs({tiny_target: (0.01, LINEAR)})  # where no draft pays: only a fixed length drafts
    plain = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=24)
    for method, options in [("spectr", {"gamma": 2}), ("cascade", {"gamma": 2}),
                            ("speculative", {"gamma_schedule": "heuristic"}),
                            ("specinfer", {"draft_budget": "method"}), ("mcsd", {"draft_budget": "method"})]:
        result = accelgen.generate(tiny_target, tokenizer, PROMPT, method=method, draft_model=tiny_target,
                                   max_new_tokens=24, **options)
        assert result.token_ids == plain.token_ids and result.stats["draft_tokens"] > 0, method
    with pytest.raises(ValueError, match="gamma must be an integer >= 1 or 'auto', got 'often'"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="speculative", draft_model=tiny_target, gamma="often")
