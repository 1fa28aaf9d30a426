"""SkipDecode: the skipped count rises with the position and never falls; no skipping = the full model."""

import pytest

import accelgen
from accelgen.exits.skipdecode import skipped_layers

CHAT = [{"role": "user", "content": "Name three colours."}]


def test_the_schedule_rises_linearly_to_its_cap_and_never_falls():
    counts = [skipped_layers(position, min_skip=2, max_skip=10, horizon=100) for position in range(300)]
    assert counts[0] == 2 and counts[50] == 6 and counts[100] == counts[299] == 10
    assert counts == sorted(counts)


def test_no_skipping_is_the_full_model(smollm):
    model, tokenizer = smollm
    expected = accelgen.generate(model, tokenizer, CHAT, max_new_tokens=16)
    result = accelgen.generate(model, tokenizer, CHAT, method="skipdecode", max_new_tokens=16, max_skip=0)
    assert result.token_ids == expected.token_ids and result.stats["mean_layers"] == 30


def test_decoded_tokens_skip_their_positions_lower_layers(smollm):
    model, tokenizer = smollm
    result = accelgen.generate(model, tokenizer, CHAT, method="skipdecode", max_new_tokens=12, min_skip=3,
                               max_skip=3)
    assert result.stats["mean_layers"] == 27 and len(result.token_ids) == 12


@pytest.mark.parametrize("options, problem", [
    ({"max_skip": 2, "min_skip": 3}, "min_skip <= max_skip < 2"),
    ({"max_skip": 2}, "max_skip < 2 layers"),
    ({"horizon": 0}, "horizon must be at least 1"),
])
def test_bad_options_are_named(tiny_target, tokenizer, options, problem):
    with pytest.raises(ValueError, match=problem):
        accelgen.generate(tiny_target, tokenizer, [5, 6], method="skipdecode", **options)
