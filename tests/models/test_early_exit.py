"""The early-exit runner: full depth when the rule never exits, the exit layer's own prediction when it does,
upper layers' KV filled from the exited state, lower layers skipped with the cache still consistent."""

import copy
from dataclasses import dataclass

import pytest
import torch

from accelgen.models.early_exit import EarlyExitRunner
from accelgen.drafters.self_speculative import skipping_runner
from accelgen.models.runner import ModelRunner

PROMPT = [5, 17, 923, 4410, 77, 12]
DECODED = [301, 42, 7]


@dataclass
class Rule:
    exit_after: int | None = None  # exit after this layer, None: never
    start: int = 0
    checked: list = None

    def first_layer(self, position):
        return self.start

    def should_exit(self, token, layer, hidden, previous, logits):
        if self.checked is not None:
            self.checked.append(layer)
        return layer == self.exit_after


@pytest.fixture(scope="module")
def four_layers(make_tiny_model):
    return make_tiny_model("qwen2", seed=5, layers=4)


def test_a_rule_that_never_exits_gives_the_models_own_logits(four_layers, assert_reordered):
    checked = []
    ours, reference = EarlyExitRunner(four_layers, Rule(checked=checked)), ModelRunner(four_layers)
    assert_reordered(ours.forward(torch.tensor(PROMPT)), reference.forward(torch.tensor(PROMPT)))
    for token in DECODED:
        assert_reordered(ours.forward(torch.tensor([token])), reference.forward(torch.tensor([token])))
    assert checked == [0, 1, 2] * len(DECODED)  # the last layer is not an exit: it is the end
    assert ours.layers_used == [4, 4, 4] and ours.describe() == {"mean_layers": 4.0, "layers": 4}
    assert ours.length == reference.length == len(PROMPT) + len(DECODED)


def test_an_exit_reads_the_exit_layer_and_fills_the_upper_caches(four_layers, assert_reordered):
    runner = EarlyExitRunner(four_layers, Rule(exit_after=1))
    runner.forward(torch.tensor(PROMPT))
    lower_only = skipping_runner(four_layers, skip_attention=[2, 3], skip_mlp=[2, 3])
    lower_only.cache = copy.deepcopy(runner.cache)  # same prompt cache: the exit depends on layers 0-1 only
    logits = runner.forward(torch.tensor([DECODED[0]]))
    assert_reordered(logits, lower_only.forward(torch.tensor([DECODED[0]])))
    assert all(layer.keys.shape[-2] == len(PROMPT) + 1 for layer in runner.cache.layers)  # state copied up
    assert runner.layers_used == [2]
    full = ModelRunner(four_layers)
    full.forward(torch.tensor(PROMPT))
    assert not torch.allclose(logits, full.forward(torch.tensor([DECODED[0]])))


def test_skipping_lower_layers_keeps_the_length_from_the_top(four_layers, assert_reordered):
    runner = EarlyExitRunner(four_layers, Rule(start=2))
    runner.forward(torch.tensor(PROMPT))
    upper_only = skipping_runner(four_layers, skip_attention=[0, 1], skip_mlp=[0, 1])
    upper_only.cache = copy.deepcopy(runner.cache)
    assert_reordered(runner.forward(torch.tensor([DECODED[0]])), upper_only.forward(torch.tensor([DECODED[0]])))
    assert [layer.keys.shape[-2] for layer in runner.cache.layers] == [6, 6, 7, 7]
    assert runner.length == 7 and runner.layers_used == [2]
    runner.keep(6, [0])  # the loop's roll-back after a step: nothing to drop
    assert runner.length == 7
    runner.reset()
    assert runner.length == 0 and runner.layers_used == []


def test_blocks_of_several_tokens_go_through_every_layer(four_layers, assert_reordered):
    runner, reference = EarlyExitRunner(four_layers, Rule(exit_after=0)), ModelRunner(four_layers)
    assert_reordered(runner.forward(torch.tensor(PROMPT)), reference.forward(torch.tensor(PROMPT)))
    assert runner.layers_used == []


def test_the_runner_keeps_the_base_interface(four_layers, assert_reordered):
    """`batches` is a property as ModelRunner's (never true: decoding steps walk the layers themselves), and a token
    with appended input embeddings (PaSS) is a block: every layer, as the plain runner gives it."""
    runner, reference = EarlyExitRunner(four_layers, Rule(exit_after=0)), ModelRunner(four_layers)
    assert isinstance(type(runner).__dict__["batches"], property) and runner.batches is False
    runner.forward(torch.tensor(PROMPT))
    reference.forward(torch.tensor(PROMPT))
    appended = torch.randn(2, four_layers.config.hidden_size, generator=torch.Generator().manual_seed(0))
    token = torch.tensor([DECODED[0]])
    assert_reordered(runner.forward(token, appended=appended), reference.forward(token, appended=appended))
    assert runner.layers_used == [] and runner.length == reference.length == len(PROMPT) + 3


def test_recomputation_leaves_the_full_models_cache(four_layers, assert_reordered):
    """EE-LLM: a token that exits gets its upper layers computed in the next step, from its own state, so the
    cache ends up exactly the full model's, while each prediction still comes from the exit layer."""
    runner = EarlyExitRunner(four_layers, Rule(exit_after=1), propagation="recompute")
    full, lower_only = ModelRunner(four_layers), skipping_runner(four_layers, skip_attention=[2, 3], skip_mlp=[2, 3])
    runner.forward(torch.tensor(PROMPT))
    full.forward(torch.tensor(PROMPT))
    for step, token in enumerate(DECODED):
        lower_only.cache = copy.deepcopy(full.cache)
        expected = lower_only.forward(torch.tensor([token]))
        assert_reordered(runner.forward(torch.tensor([token])), expected)
        full.forward(torch.tensor([token]))
        top = runner.cache.layers[3].keys.shape[-2]
        assert runner.length == len(PROMPT) + step + 1 and top == runner.length - 1  # the last one is pending
    for layer_ours, layer_full in zip(runner.cache.layers, full.cache.layers):
        held = layer_ours.keys.shape[-2]
        assert_reordered(layer_ours.keys, layer_full.keys[..., :held, :])
        assert_reordered(layer_ours.values, layer_full.values[..., :held, :])
    assert runner.layers_used == [2, 2, 2]


def test_copying_approximates_the_upper_layers(four_layers, assert_reordered):
    runner = EarlyExitRunner(four_layers, Rule(exit_after=1), propagation="copy")
    full = ModelRunner(four_layers)
    for model_runner in (runner, full):
        model_runner.forward(torch.tensor(PROMPT))
        model_runner.forward(torch.tensor([DECODED[0]]))
    assert_reordered(runner.cache.layers[1].keys, full.cache.layers[1].keys)
    assert not torch.allclose(runner.cache.layers[3].keys, full.cache.layers[3].keys)
    with pytest.raises(ValueError, match="propagation must be one of copy, recompute"):
        EarlyExitRunner(four_layers, Rule(), propagation="drop")


@dataclass
class ExitTwiceThenGoDeep:
    """Exits after layer 1 for the first two decoded tokens, then never; records what it is shown."""

    calls: int = 0
    seen: list = None

    def first_layer(self, position):
        return 0

    def should_exit(self, token, layer, hidden, previous, logits):
        if layer != 1:
            return False
        self.calls += 1
        logits()  # computed, so that a deep token's exit prediction can be observed
        return self.calls <= 2

    def observe(self, layer, shallow, deep):
        self.seen.append((layer, shallow.shape[0], deep.shape[0]))


def test_synchronized_decoding_runs_waiting_tokens_beside_the_next_deep_one(four_layers, assert_reordered):
    """FREE: exited tokens wait; the next token that goes deep carries their upper layers, and the cache ends
    up exactly the full model's; the rule sees exit predictions beside the deep ones."""
    rule = ExitTwiceThenGoDeep(seen=[])
    runner = EarlyExitRunner(four_layers, rule, propagation="synchronized")
    full, lower_only = ModelRunner(four_layers), skipping_runner(four_layers, skip_attention=[2, 3], skip_mlp=[2, 3])
    runner.forward(torch.tensor(PROMPT))
    full.forward(torch.tensor(PROMPT))
    for step, token in enumerate(DECODED):
        if step < 2:
            lower_only.cache = copy.deepcopy(full.cache)
            expected = lower_only.forward(torch.tensor([token]))
        full_logits = full.forward(torch.tensor([token]))
        assert_reordered(runner.forward(torch.tensor([token])), expected if step < 2 else full_logits)
        assert runner.length == len(PROMPT) + step + 1
    assert runner.pending is None and runner.layers_used == [2, 2, 4]
    for layer_ours, layer_full in zip(runner.cache.layers, full.cache.layers):
        assert_reordered(layer_ours.keys, layer_full.keys)
        assert_reordered(layer_ours.values, layer_full.values)
    assert rule.seen == [(1, 2, 2), (1, 1, 1)]  # the two waiting tokens, then the deep token's own exit


def test_synchronized_decoding_needs_one_exit_layer(four_layers):
    runner = EarlyExitRunner(four_layers, Rule(exit_after=1), propagation="synchronized")
    runner.forward(torch.tensor(PROMPT))
    runner.forward(torch.tensor([DECODED[0]]))
    runner.rule = Rule(exit_after=0)
    with pytest.raises(ValueError, match="every exit at one layer"):
        runner.forward(torch.tensor([DECODED[1]]))
