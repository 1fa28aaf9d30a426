"""EE-LLM's recomputation through the method: threshold 1.0 is the full model, threshold 0 exits at the first
allowed layer. (That the recomputed cache is exactly the full model's is tested in tests/models/test_early_exit.py.)"""

import accelgen

CHAT = [{"role": "user", "content": "Name three colours."}]


def test_threshold_one_is_the_full_model(smollm):
    model, tokenizer = smollm
    expected = accelgen.generate(model, tokenizer, CHAT, max_new_tokens=16)
    result = accelgen.generate(model, tokenizer, CHAT, method="ee-recompute", max_new_tokens=16, threshold=1.0)
    assert result.token_ids == expected.token_ids and result.stats["mean_layers"] == 30


def test_exits_with_every_upper_layer_recomputed(smollm):
    model, tokenizer = smollm
    result = accelgen.generate(model, tokenizer, CHAT, method="ee-recompute", max_new_tokens=16, threshold=0.0)
    assert result.stats["mean_layers"] == 16 and len(result.token_ids) == 16
