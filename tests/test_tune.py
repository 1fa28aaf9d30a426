from accelgen.tune import tune_self_speculative


def test_tuning_returns_a_skip_set_no_slower_than_its_start(tiny_target, tokenizer):
    result = tune_self_speculative(tiny_target, tokenizer, [[5, 17, 923, 4410]], trials=3, max_new_tokens=6)
    layers = range(tiny_target.config.num_hidden_layers)
    assert set(result["skip"]) == {"skip_attention", "skip_mlp"}
    assert all(i in layers for i in result["skip"]["skip_attention"] + result["skip"]["skip_mlp"])
    assert len(result["skip"]["skip_attention"]) < len(layers)
    assert result["seconds_per_token"] > 0 and result["speedup"] > 0 and result["trials"] == 3
