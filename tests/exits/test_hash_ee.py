"""Hash EE: a token's depth is a fixed function of its id; only the full depth allowed = the full model."""

from collections import Counter

import pytest

import accelgen
from accelgen.exits.hash_ee import hashed_exit_layer

CHAT = [{"role": "user", "content": "Name three colours."}]


def test_the_hash_is_fixed_and_spreads_tokens_evenly():
    layers = (15, 22, 29)
    # Knuth's multiplicative hash, token * 2654435761 mod 2^32, picks the layer: pinned, so no run or process differs
    assert [hashed_exit_layer(token, layers) for token in range(10)] == [15, 22, 22, 29, 29, 29, 15, 15, 22, 22]
    assert [hashed_exit_layer(token, layers) for token in (12345, 30000, 49151)] == [15, 29, 22]
    counts = Counter(hashed_exit_layer(token, layers) for token in range(30000))
    assert set(counts) == set(layers) and min(counts.values()) > 9000


def test_only_the_last_layer_is_the_full_model(smollm):
    model, tokenizer = smollm
    expected = accelgen.generate(model, tokenizer, CHAT, max_new_tokens=16)
    result = accelgen.generate(model, tokenizer, CHAT, method="hash-ee", max_new_tokens=16, exit_layers=[29])
    assert result.token_ids == expected.token_ids and result.stats["mean_layers"] == 30


def test_each_decoded_token_exits_where_its_id_hashes(smollm):
    model, tokenizer = smollm
    layers = (15, 22, 29)
    result = accelgen.generate(model, tokenizer, CHAT, method="hash-ee", max_new_tokens=16, exit_layers=list(layers))
    decoded = result.token_ids[:-1]  # the prompt's forward goes through every layer; then each step decodes a root
    expected = sum(hashed_exit_layer(token, layers) + 1 for token in decoded) / len(decoded)
    assert result.stats["mean_layers"] == pytest.approx(expected)
