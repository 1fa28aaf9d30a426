"""Cache crop and gather-compact leave exactly the cache a fresh forward over the kept tokens would build."""

import torch

from accelgen import cache as kv
from accelgen.models.runner import ModelRunner


def _keys(runner):
    return torch.stack([layer.keys for layer in runner.cache.layers])


def test_crop_equals_shorter_forward(tiny_target, assert_reordered):
    tokens = torch.tensor([5, 9, 13, 17, 21, 25])
    full, short = ModelRunner(tiny_target), ModelRunner(tiny_target)
    full.forward(tokens)
    short.forward(tokens[:4])
    kv.crop(full.cache, 4)
    assert full.length == 4
    assert_reordered(_keys(full), _keys(short))


def test_compact_gathers_a_tree_path(tiny_target, assert_reordered):
    prefix = torch.tensor([5, 9, 13])
    #   root(40) ─ a(41) ─ b(42)
    #            └ c(43) ─ d(44)      accept c, d: rows 0, 3, 4
    tree_tokens = torch.tensor([40, 41, 42, 43, 44])
    parents = torch.tensor([-1, 0, -1, 2])
    from accelgen.draft import tree_attention

    runner = ModelRunner(tiny_target)
    runner.forward(prefix)
    tree_logits = runner.forward(tree_tokens, tree_attention(parents))
    runner.keep(3, [0, 3, 4])

    reference = ModelRunner(tiny_target)
    reference.forward(prefix)
    path_logits = reference.forward(torch.tensor([40, 43, 44]))
    assert runner.length == reference.length == 6
    assert_reordered(_keys(runner), _keys(reference))
    # the tree forward scored the path exactly as a causal forward over the path does
    assert_reordered(tree_logits[[0, 3, 4]], path_logits)
    # and the next forward after compaction agrees too
    assert_reordered(runner.forward(torch.tensor([7])), reference.forward(torch.tensor([7])))


def test_keep_with_contiguous_rows_is_a_crop(tiny_target):
    runner = ModelRunner(tiny_target)
    runner.forward(torch.tensor([1, 2, 3, 4, 5]))
    runner.keep(2, [0, 1])
    assert runner.length == 4


def test_kept_hidden_states_follow_the_cache(tiny_target, assert_reordered):
    """With keep_hidden, the runner holds the final hidden state of every cached position, rolled back with it."""
    from accelgen.draft import tree_attention

    runner = ModelRunner(tiny_target)
    runner.keep_hidden = True
    runner.forward(torch.tensor([5, 9, 13]))
    runner.forward(torch.tensor([40, 41, 42, 43, 44]), tree_attention(torch.tensor([-1, 0, -1, 2])))
    runner.keep(3, [0, 3, 4])  # root 40, then the path c(43) ─ d(44)
    with torch.no_grad():
        expected = tiny_target.model(input_ids=torch.tensor([[5, 9, 13, 40, 43, 44]])).last_hidden_state[0]
    assert runner.hidden.shape == (6, 64)
    assert_reordered(runner.hidden, expected)
    runner.keep(4, [])
    assert runner.hidden.shape == (4, 64)
