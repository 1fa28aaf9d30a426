"""`auto`: delegates to the calibrated (or default) method, stays lossless, explains its choice."""

import json

import pytest

import accelgen
from accelgen.drafters.auto import AUTO_FILE, candidates, load_choice, save_choice
from accelgen.tune import tune_auto

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12, 5, 17, 923]


def test_uncalibrated_auto_falls_back_and_says_why(tiny_target, tokenizer, assert_lossless):
    with_draft = assert_lossless(tiny_target, tokenizer, PROMPT, "auto", 24, draft_model=tiny_target)
    assert with_draft.stats["choice"]["method"] == "speculative"
    assert with_draft.stats["choice"]["options"] == {"gamma_schedule": "cost"}
    assert "not calibrated" in with_draft.stats["choice"]["reason"]
    alone = assert_lossless(tiny_target, tokenizer, PROMPT, "auto", 24)
    assert alone.stats["choice"]["method"] == "pld"


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
    assert "fastest of" in result["reason"]
    assert [row["method"] for row in tune_auto(model, tokenizer, [PROMPT], max_new_tokens=4)["table"]] == \
        [method for method, _ in candidates(False)]
