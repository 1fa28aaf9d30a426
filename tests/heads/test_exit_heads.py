"""Exit heads: untrained, an exit through them is the plain exit."""

import accelgen
from accelgen.heads.exit_heads import ExitHeads

PROMPT = [5, 17, 923, 4410, 77, 12]


def test_untrained_heads_are_the_plain_exit(make_tiny_model, tokenizer, tmp_path):
    four_layers = make_tiny_model("qwen2", seed=6, layers=4)
    ExitHeads([1, 2], 64, 8, layer_count=4, vocab_size=49152).save(tmp_path / "fresh")
    plain = accelgen.generate(four_layers, tokenizer, PROMPT, method="calm", max_new_tokens=8, threshold=0.0,
                              exit_layers=[1])
    headed = accelgen.generate(four_layers, tokenizer, PROMPT, method="calm", max_new_tokens=8, threshold=0.0,
                               exit_layers=[1], heads=str(tmp_path / "fresh"))
    assert headed.token_ids == plain.token_ids and headed.stats["mean_layers"] == 2
