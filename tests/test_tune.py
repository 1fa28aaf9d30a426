import pytest

from accelgen import tune
from accelgen.drafters.self_speculative import default_skip
from accelgen.tune import tune_self_speculative


def test_tuning_returns_a_skip_set_no_slower_than_its_start(make_tiny_model, tokenizer, monkeypatch):
    model = make_tiny_model("qwen2", layers=4)  # 8 choices per trial: a first trial is the default by design only
    measured = []  # (method options, seconds per token) of every timing, in order
    real_seconds_per_token = tune.seconds_per_token

    def timed(model, tokenizer, prompts, max_new_tokens, **method):
        cost = real_seconds_per_token(model, tokenizer, prompts, max_new_tokens, **method)
        measured.append((method, cost[0]))
        return cost

    monkeypatch.setattr(tune, "seconds_per_token", timed)
    result = tune_self_speculative(model, tokenizer, [[5, 17, 923, 4410]], trials=3, max_new_tokens=6)
    layers = range(model.config.num_hidden_layers)
    assert set(result["skip"]) == {"skip_attention", "skip_mlp"}
    assert all(i in layers for i in result["skip"]["skip_attention"] + result["skip"]["skip_mlp"])
    assert len(result["skip"]["skip_attention"]) < len(layers)
    (plain, plain_cost), *trials = measured
    assert plain["method"] == "autoregressive" and result["autoregressive_seconds_per_token"] == plain_cost
    # the first trial is the default skip set, and the result is the fastest trial: never slower than that start
    assert trials[0][0]["skip"] == default_skip(len(layers)) and all(m["method"] == "self-speculative" for m, _ in trials)
    assert len(trials) <= 3 and result["seconds_per_token"] == min(cost for _, cost in trials) <= trials[0][1]
    assert (result["skip"], result["seconds_per_token"]) in [(m["skip"], cost) for m, cost in trials]
    assert result["speedup"] == pytest.approx(plain_cost / result["seconds_per_token"]) and result["trials"] == 3


def test_calibration_prompts_spread_over_the_second_half():
    from accelgen.cli.tune import calibration_prompts

    assert calibration_prompts(list(range(100)), 4) == [50, 62, 75, 87]
    assert calibration_prompts(list(range(10)), 8) == [5, 6, 7, 8, 9]  # fewer there than asked: all of them
