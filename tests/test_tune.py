from accelgen.tune import tune_self_speculative


def test_tuning_returns_a_skip_set_no_slower_than_its_start(tiny_target, tokenizer):
    result = tune_self_speculative(tiny_target, tokenizer, [[5, 17, 923, 4410]], trials=3, max_new_tokens=6)
    layers = range(tiny_target.config.num_hidden_layers)
    assert set(result["skip"]) == {"skip_attention", "skip_mlp"}
    assert all(i in layers for i in result["skip"]["skip_attention"] + result["skip"]["skip_mlp"])
    assert len(result["skip"]["skip_attention"]) < len(layers)
    assert result["seconds_per_token"] > 0 and result["speedup"] > 0 and result["trials"] == 3


def test_calibration_prompts_spread_over_the_second_half():
    from accelgen.cli import calibration_prompts

    assert calibration_prompts(list(range(100)), 4) == [50, 62, 75, 87]
    assert calibration_prompts(list(range(10)), 8) == [5, 6, 7, 8, 9]  # fewer there than asked: all of them
