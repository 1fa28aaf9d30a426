"""The static KV cache (models/static.py) on the CPU, where it runs without CUDA graphs but with the same buckets,
padding, masks, roll-back and gather as on a GPU: token-identical to the dynamic cache for chains, trees and
kept hidden states; forwards padded to a bucket give the unpadded logits; capacity grows; clear refusals."""

import pytest
import torch

import accelgen
from accelgen.draft import tree_attention
from accelgen.models.engines import runner_for
from accelgen.models.runner import ModelRunner
from accelgen.models.static import BUCKETS, StaticRunner, bucket_for

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12, 5, 17, 923]


def test_buckets_hold_their_widths():
    assert [bucket_for(m) for m in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket_for(BUCKETS[-1] + 1) is None  # a prompt: an eager forward


@pytest.mark.parametrize("width", [1, 3, 5, 8, 70])
def test_a_padded_forward_gives_the_unpadded_logits(tiny_target, width):
    dynamic, static = ModelRunner(tiny_target), StaticRunner(tiny_target)
    for runner in (dynamic, static):
        runner.forward(torch.tensor(PROMPT), logits_for_last=1)
    block = torch.arange(30, 30 + width)
    expected = dynamic.forward(block, logits_for_last=width)
    got = static.forward(block, logits_for_last=width)
    assert got.shape == expected.shape and static.length == dynamic.length == len(PROMPT) + width
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_a_tree_path_is_gathered_as_the_dynamic_cache_keeps_it(tiny_target):
    """Root + tree a(0) - b(1), c(2) - d(3): keeping the path c, d compacts it behind the root; the next forward
    sees exactly what the dynamic cache's next forward sees."""
    parents = torch.tensor([-1, 0, -1, 2])
    tokens = torch.tensor([PROMPT[-1], 40, 41, 42, 43])  # the root, then the nodes
    dynamic, static = ModelRunner(tiny_target), StaticRunner(tiny_target)
    for runner in (dynamic, static):
        runner.forward(torch.tensor(PROMPT[:-1]), logits_for_last=1)
        runner.forward(tokens, tree_attention(parents), logits_for_last=5)
        runner.keep(len(PROMPT) - 1, [0, 3, 4])  # the root, c, d
    assert static.length == dynamic.length == len(PROMPT) + 2
    torch.testing.assert_close(static.forward(torch.tensor([7, 8])), dynamic.forward(torch.tensor([7, 8])),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method, options", [
    ("autoregressive", {}), ("pld", {"draft_budget": "method"}), ("lookahead-decoding", {}), ("jacobi", {}),
    ("trie-lookahead", {}), ("speculative", {"gamma": 4}), ("specinfer", {})])
def test_generation_is_token_identical_to_the_dynamic_cache(tiny_target, tokenizer, greedy, method, options):
    if method in ("speculative", "specinfer"):
        options = {**options, "draft_model": tiny_target}  # every draft token accepted: whole chains and paths
    result = accelgen.generate(tiny_target, tokenizer, PROMPT * 2, method=method, max_new_tokens=40, cache="static",
                               **options)
    assert result.token_ids == greedy(tiny_target, tokenizer, PROMPT * 2, 40).token_ids
    assert result.stats["cache"] == "static"


def test_a_random_draft_rejected_every_step_changes_nothing(tiny_target, make_tiny_model, tokenizer, greedy):
    other = make_tiny_model("llama", seed=1)
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, method="specinfer", draft_model=other,
                               max_new_tokens=30, cache="static", draft_budget="method")
    assert result.token_ids == greedy(tiny_target, tokenizer, PROMPT, 30).token_ids
    assert result.stats["accepted_draft_tokens"] < result.stats["draft_tokens"]


def test_the_cache_grows_past_its_first_capacity(tiny_target, tokenizer, greedy):
    runner = StaticRunner(tiny_target, capacity=16)
    logits = [runner.forward(torch.tensor(PROMPT), logits_for_last=1)[-1]]
    tokens = []
    for _ in range(30):
        tokens.append(int(logits[-1].argmax()))
        logits.append(runner.forward(torch.tensor(tokens[-1:]))[-1])
    assert runner.cache.capacity >= len(PROMPT) + 30
    assert tokens == greedy(tiny_target, tokenizer, PROMPT, 30).token_ids


def test_hidden_states_are_kept_and_rolled_back(tiny_target):
    dynamic, static = ModelRunner(tiny_target), StaticRunner(tiny_target)
    for runner in (dynamic, static):
        runner.keep_hidden = True
        runner.forward(torch.tensor(PROMPT), logits_for_last=1)
        runner.forward(torch.tensor([3, 4, 5]), tree_attention(torch.tensor([-1, -1])), logits_for_last=3)
        runner.keep(len(PROMPT), [0, 2])
    assert static.hidden.shape == dynamic.hidden.shape == (len(PROMPT) + 2, tiny_target.config.hidden_size)
    torch.testing.assert_close(static.hidden, dynamic.hidden, atol=1e-4, rtol=1e-4)


def test_heads_read_the_static_runners_states(tiny_target, make_tiny_model, tokenizer, greedy, tmp_path):
    """Medusa and EAGLE read the final hidden states, EAGLE-3 three layers' inputs (output_hidden_states)."""
    from accelgen.heads.eagle import new_head
    from accelgen.heads.eagle3 import new_eagle3_head
    from accelgen.heads.medusa import MedusaHeads

    four_layers = make_tiny_model("qwen2", seed=0, layers=4)
    MedusaHeads(3, 64, 49152).save(tmp_path / "medusa")
    new_head(tiny_target).save(tmp_path / "eagle")
    new_eagle3_head(four_layers).save(tmp_path / "eagle3")
    for model, method, folder in [(tiny_target, "medusa", "medusa"), (tiny_target, "eagle", "eagle"),
                                  (four_layers, "eagle", "eagle3")]:
        result = accelgen.generate(model, tokenizer, PROMPT, method=method, heads=str(tmp_path / folder),
                                   max_new_tokens=24, cache="static")
        assert result.token_ids == greedy(model, tokenizer, PROMPT, 24).token_ids, folder


def test_the_choice_of_cache(tiny_target, make_tiny_model, tokenizer):
    assert type(runner_for(tiny_target)) is ModelRunner  # "auto" on the CPU: the dynamic cache
    assert type(runner_for(tiny_target, "static")) is StaticRunner
    with pytest.raises(ValueError, match="unknown cache 'paged'"):
        runner_for(tiny_target, "paged")
    with pytest.raises(ValueError, match="keeps the KV cache its own way"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="calm", max_new_tokens=4, cache="static")
    windowed = make_tiny_model("qwen2", seed=0)
    windowed.config.use_sliding_window, windowed.config.sliding_window = True, 4
    windowed.config.max_window_layers = 0
    windowed.config.layer_types = ["sliding_attention"] * windowed.config.num_hidden_layers
    with pytest.raises(ValueError, match="sliding-window layers: decode it with cache='dynamic'"):
        StaticRunner(windowed)
    assert type(runner_for(windowed)) is ModelRunner


def test_transformers_cache_implementation_chooses_the_cache(tiny_target, tokenizer):
    from transformers import GenerationConfig

    result = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=4,
                               generation_config=GenerationConfig(cache_implementation="static"))
    assert result.stats["cache"] == "static"
    with pytest.raises(ValueError, match="cache_implementation='offloaded'"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=4,
                          generation_config=GenerationConfig(cache_implementation="offloaded"))


def test_a_closed_runners_slot_serves_the_next_sequence(tiny_target):
    """Graphs are captured per slot: a closed (or collected) runner's slot, stale cache and all, is the next
    runner's, while runners alive at once hold slots of their own."""
    first, second = StaticRunner(tiny_target), StaticRunner(tiny_target)
    assert first.slot is not second.slot
    slot = first.slot
    first.forward(torch.tensor(PROMPT), logits_for_last=1)
    first.close()
    third = StaticRunner(tiny_target)
    assert third.slot is slot and third.length == 0
    expected = ModelRunner(tiny_target).forward(torch.tensor(PROMPT[:4]))
    torch.testing.assert_close(third.forward(torch.tensor(PROMPT[:4])), expected, atol=1e-4, rtol=1e-4)


def test_a_draft_tree_grows_level_by_level_on_the_static_cache(tiny_target):
    """Tree drafters score each level over the levels already cached ((m, t + m) patterns), then drop the tree:
    the static cache gives the dynamic cache's logits at every level."""
    from accelgen.drafters.draft_tree import DraftModelScorer

    dynamic, static = DraftModelScorer(tiny_target), DraftModelScorer(tiny_target)
    static.runner = StaticRunner(tiny_target)
    tokens, parents = torch.tensor([40, 41, 42, 43, 44]), [-1, -1, 0, 1, 2]
    for scorer in (dynamic, static):
        scorer.results = [scorer.root_logits(PROMPT), scorer.score(tokens, parents, [0, 1]),
                          scorer.score(tokens, parents, [2, 3]), scorer.score(tokens, parents, [4]),
                          scorer.root_logits(PROMPT + [7, 8])]
    for expected, got in zip(dynamic.results, static.results):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
