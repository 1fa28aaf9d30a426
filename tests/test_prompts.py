"""Token-id prompts need no tokenizer: generation runs on ids, ending at the model's own EOS ids."""

import pytest

import accelgen
from accelgen.prompts import eos_token_ids

PROMPT = [5, 17, 923, 77, 12, 5, 17]


@pytest.fixture
def fresh_model(make_tiny_model):
    """A tiny model of its own (its generation config is changed by the tests)."""
    return make_tiny_model("qwen2", seed=2, vocab_size=1000)


@pytest.mark.parametrize("method", ["autoregressive", "pld", "speculative"])
def test_token_ids_generate_without_a_tokenizer(fresh_model, tokenizer, method):
    with_tokenizer = accelgen.generate(fresh_model, tokenizer, PROMPT, method=method, draft_model=fresh_model,
                                       max_new_tokens=8)
    without = accelgen.generate(fresh_model, None, PROMPT, method=method, draft_model=fresh_model, max_new_tokens=8)
    assert without.token_ids == with_tokenizer.token_ids and len(without.token_ids) == 8
    assert without.text == "" and without.finish_reason == "length"
    several = accelgen.generate(fresh_model, None, [PROMPT, PROMPT[:3]], method=method, draft_model=fresh_model,
                                max_new_tokens=4)
    assert several[0].token_ids == with_tokenizer.token_ids[:4]


def test_eos_comes_from_the_generation_config_else_the_config(fresh_model):
    plain = accelgen.generate(fresh_model, None, PROMPT, max_new_tokens=8).token_ids
    stop_at = plain[3]
    assert stop_at not in plain[:3]  # (so that the stop is the first occurrence)
    fresh_model.generation_config.eos_token_id = stop_at
    ended = accelgen.generate(fresh_model, None, PROMPT, max_new_tokens=8)
    assert ended.token_ids == plain[:4] and ended.finish_reason == "stop"
    fresh_model.generation_config.eos_token_id = None
    fresh_model.config.eos_token_id = [stop_at]
    assert eos_token_ids(fresh_model, None) == {stop_at}
    assert accelgen.generate(fresh_model, None, PROMPT, max_new_tokens=8).token_ids == plain[:4]
    fresh_model.config.eos_token_id = None
    assert eos_token_ids(fresh_model, None) == set()  # no EOS anywhere: generation runs to its limit
    assert accelgen.generate(fresh_model, None, PROMPT, max_new_tokens=8).token_ids == plain


@pytest.mark.parametrize("prompt,options,message", [
    ("some text", {}, "a text prompt needs a tokenizer"),
    ([{"role": "user", "content": "hi"}], {}, "a chat prompt needs a tokenizer"),
    ([], {}, "empty prompt and no tokenizer"),
    (PROMPT, {"stop": ["\n"]}, "stop strings need a tokenizer"),
    (PROMPT, {"response_format": {"type": "json_object"}}, "response_format 'json_object' needs a tokenizer"),
], ids=["text", "chat", "empty", "stop", "response_format"])
def test_what_needs_a_tokenizer_says_so(fresh_model, prompt, options, message):
    with pytest.raises(ValueError, match=message):
        accelgen.generate(fresh_model, None, prompt, max_new_tokens=2, **options)
