"""`auto`: delegates to the calibrated (or default) method, stays lossless, explains its choice."""

import copy
import json

import pytest

import accelgen
from accelgen.drafters.auto import AUTO_FILE, candidates, load_choice, save_choice
from accelgen.tune import tune_auto

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12, 5, 17, 923]


# r(k) of the 1.5B in bf16: on an AVX2-only EPYC (measured), and on a CPU with native bf16 matrix units
AVX2 = {1: 1.0, 2: 1.64, 4: 2.8, 8: 5.9, 16: 11.5}
NATIVE_BF16 = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.15, 16: 1.47}
LINEAR = {1: 1.0, 16: 16.0}
FLAT = {1: 1.0, 16: 1.0}


@pytest.fixture(autouse=True)
def no_self_draft(monkeypatch):
    """These tests choose among a draft model, prompt lookup and plain decoding; auto's choice of the target's own
    quantized copy (qspec) is tested in test_qspec.py."""
    monkeypatch.setattr("accelgen.drafters.auto.self_draft", lambda target_model, tokenizer=None: None)


@pytest.fixture
def cheap_draft(tiny_target):
    """The target's own weights (its drafts are always right), under another name: timed as a draft model."""
    draft = copy.deepcopy(tiny_target)
    draft.config._name_or_path = "cheap-draft"
    return draft


@pytest.mark.parametrize("ratios, with_draft, without_draft", [
    (FLAT, "speculative", "pld"),
    (NATIVE_BF16, "speculative", "pld"),
    (AVX2, "autoregressive", "autoregressive"),  # c = 0.3 and r(2) = 1.64: not even free drafts pay at α = 0.6
    (LINEAR, "autoregressive", "autoregressive"),
])
def test_uncalibrated_auto_chooses_by_the_measured_costs_and_says_why(measured_costs, tiny_target, cheap_draft,
                                                                     tokenizer, assert_lossless, ratios, with_draft,
                                                                     without_draft):
    measured_costs({tiny_target: (0.2, ratios), cheap_draft: (0.06, ratios)})  # c = 0.3
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "auto", 24, draft_model=cheap_draft)
    choice = result.stats["choice"]
    assert choice["method"] == with_draft and "not calibrated" in choice["reason"] and "c = 0.30" in choice["reason"]
    if with_draft == "speculative":
        assert choice["options"] == {"gamma_schedule": "cost"} and "predicted" in choice["reason"]
        assert result.stats["draft_tokens"] > 0
    else:
        assert "no draft length pays" in choice["reason"] and result.stats["draft_tokens"] == 0
    alone = assert_lossless(tiny_target, tokenizer, PROMPT, "auto", 24)
    assert alone.stats["choice"]["method"] == without_draft


def test_uncalibrated_auto_takes_prompt_lookup_where_only_free_drafts_pay(measured_costs, tiny_target, cheap_draft,
                                                                          tokenizer, assert_lossless):
    measured_costs({tiny_target: (0.2, NATIVE_BF16), cheap_draft: (0.2, NATIVE_BF16)})  # c = 1: the draft is as slow
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "auto", 24, draft_model=cheap_draft)
    assert result.stats["choice"]["method"] == "pld" and "prompt lookup" in result.stats["choice"]["reason"]


def test_saved_choice_is_used_per_draft_and_workload(make_tiny_model, tokenizer, greedy, tmp_path):
    model = make_tiny_model("qwen2")
    model.name_or_path = str(tmp_path)
    save_choice(model, None, "code", {"method": "lookahead-decoding", "options": {"window_size": 3}, "reason": "test"})
    save_choice(model, None, "chat", {"method": "pld", "options": {"max_ngram": 2}, "reason": "test"})
    saved = json.loads((tmp_path / AUTO_FILE).read_text())
    assert saved["no-draft"]["latest"] == "chat"
    assert load_choice(model, None, "")["method"] == "pld"
    result = accelgen.generate(model, tokenizer, PROMPT, method="auto", workload="code", max_new_tokens=20)
    assert result.stats["choice"] == {"method": "lookahead-decoding", "options": {"window_size": 3}, "reason": "test"}
    assert result.token_ids == greedy(model, tokenizer, PROMPT, 20).token_ids
    with pytest.raises(ValueError, match="no calibration saved for workload 'math'"):
        accelgen.generate(model, tokenizer, PROMPT, method="auto", workload="math", max_new_tokens=2)


def test_calibration_times_every_candidate_and_picks_the_fastest(make_tiny_model, tokenizer):
    model = make_tiny_model("qwen2")
    seen = []
    result = tune_auto(model, tokenizer, [PROMPT, PROMPT[::-1]], draft_model=model, max_new_tokens=8,
                       progress=lambda done, total, row: seen.append((done, total)))
    assert len(result["table"]) == len(candidates(True)) and seen[-1][0] == seen[-1][1] - 1
    assert len(candidates(True)) < len(seen) <= 2 * len(candidates(True))  # round two: the contenders only
    fastest = max(result["table"], key=lambda row: row["speedup"])
    assert (result["method"], result["options"]) == (fastest["method"], fastest["options"])
    assert result["table"][0]["method"] == "autoregressive" and result["table"][0]["speedup"] == 1.0
    assert ("no candidate beat plain decoding" if result["method"] == "autoregressive" else "fastest of") in result["reason"]
    assert [row["method"] for row in tune_auto(model, tokenizer, [PROMPT], max_new_tokens=4)["table"]] == \
        [method for method, _ in candidates(False)]


def test_calibration_keeps_plain_decoding_when_nothing_beats_it(make_tiny_model, tokenizer, monkeypatch):
    import accelgen.tune

    def timed(model, tokenizer, prompts, max_new_tokens, method, **options):  # every candidate slower than plain
        return (1.0, 1.0) if method == "autoregressive" else (1.25, 2.0)

    monkeypatch.setattr(accelgen.tune, "seconds_per_token", timed)
    result = tune_auto(make_tiny_model("qwen2"), tokenizer, [PROMPT], max_new_tokens=4)
    assert result["method"] == "autoregressive" and result["options"] == {}
    assert result["reason"].startswith("no candidate beat plain decoding") and "0.80×" in result["reason"]


@pytest.mark.parametrize("ratios, chosen", [(FLAT, "eagle"), (AVX2, "autoregressive")])
def test_uncalibrated_auto_considers_the_head_shipped_for_an_embedded_model(measured_costs, smollm, assert_lossless,
                                                                           ratios, chosen):
    """SmolLM2 ships an EAGLE head: auto weighs it at the head's recorded top-1 and its draft step's timed cost, and
    drafts with it where verification is cheap (a GPU's flat r(k)), not where it is not (an AVX2 CPU's)."""
    model, tokenizer = smollm
    measured_costs({model: (0.2, ratios)})
    result = assert_lossless(model, tokenizer, [{"role": "user", "content": "Name three colors."}], "auto", 24)
    choice = result.stats["choice"]
    assert choice["method"] == chosen and "shipped EAGLE head's draft step c = " in choice["reason"], choice
    assert ("EAGLE head shipped for this model" in choice["reason"]) == (chosen == "eagle")
    assert candidates(False, has_head=True).count(("eagle", {})) == 1
