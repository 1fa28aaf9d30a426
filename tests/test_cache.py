"""Cache crop and gather-compact leave exactly the cache a fresh forward over the kept tokens would build."""

import pytest
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


def _tiny(model_type: str, **options):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=1024, initializer_range=0.2, **options)
    return AutoModelForCausalLM.from_config(config).eval()


LLAMA_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)
# windowed models with a window of 4 positions, which a tree at the end of 8 cached tokens crosses: Mistral (every
# layer windowed: one mask), Gemma 2 (windowed and full layers: a mask per layer type)
WINDOWED = {"mistral": ("mistral", LLAMA_SHAPE), "gemma2": ("gemma2", {**LLAMA_SHAPE, "head_dim": 16})}
# ALiBi models, whose biases follow a tree node's depth, not its place in the cache
ALIBI = {"bloom": ("bloom", dict(hidden_size=64, n_layer=2, n_head=4)),
         "mpt": ("mpt", dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=256))}
PREFIX = [5, 9, 13, 17, 21, 25, 29, 33]
#   root(40) ─ a(41) ─ b(42)
#            └ c(43) ─ d(44) ─ e(45)      the path root, c, d, e: rows 0, 3, 4, 5
TREE_TOKENS, TREE_PARENTS, PATH_ROWS = [40, 41, 42, 43, 44, 45], [-1, 0, -1, 2, 3], [0, 3, 4, 5]


def _tree_and_path_logits(model) -> tuple[torch.Tensor, torch.Tensor, ModelRunner, ModelRunner]:
    """(the tree forward's logits of the path's rows, the causal forward's over the path) after PREFIX, and the
    two runners, the tree's compacted to the path."""
    from accelgen.draft import tree_attention

    tree, chain = ModelRunner(model), ModelRunner(model)
    tree.forward(torch.tensor(PREFIX))
    chain.forward(torch.tensor(PREFIX))
    tree_logits = tree.forward(torch.tensor(TREE_TOKENS), tree_attention(torch.tensor(TREE_PARENTS)))
    tree.keep(len(PREFIX), PATH_ROWS)
    path_logits = chain.forward(torch.tensor([TREE_TOKENS[row] for row in PATH_ROWS]))
    return tree_logits[PATH_ROWS], path_logits, tree, chain


@pytest.mark.parametrize("kind", [*WINDOWED, *ALIBI])
def test_a_tree_scores_each_path_as_a_chain_over_it_does(kind, assert_reordered):
    """Sliding windows (the tree's masks block what the window leaves out) and ALiBi (biases by tree depth)."""
    model_type, options = {**WINDOWED, **ALIBI}[kind]
    model = _tiny(model_type, **options, **({"sliding_window": 4} if kind in WINDOWED else {}))
    tree_logits, path_logits, tree, chain = _tree_and_path_logits(model)
    assert_reordered(tree_logits, path_logits)
    assert tree.length == chain.length == len(PREFIX) + len(PATH_ROWS)
    assert_reordered(tree.forward(torch.tensor([7, 8])), chain.forward(torch.tensor([7, 8])))  # after the gather


@pytest.mark.parametrize("kind", list(WINDOWED))
def test_the_window_changes_what_the_tree_sees(kind):
    """The same weights without a window score the tree otherwise: the window test above is not vacuous."""
    model_type, options = WINDOWED[kind]
    windowed, _, _, _ = _tree_and_path_logits(_tiny(model_type, **options, sliding_window=4))
    unwindowed, _, _, _ = _tree_and_path_logits(_tiny(model_type, **options, sliding_window=4096))
    assert not torch.allclose(windowed, unwindowed, atol=1e-3)


def test_a_sliding_window_model_keeps_a_full_cache_it_can_crop():
    model = _tiny("gemma2", **LLAMA_SHAPE, head_dim=16, sliding_window=4)
    assert kv.layer_windows(model.config) == [4, None]
    runner = ModelRunner(model)
    runner.forward(torch.tensor(PREFIX))
    assert [layer.keys.shape[-2] for layer in runner.cache.layers] == [len(PREFIX)] * 2  # nothing dropped
    runner.keep(3, [0])
    assert runner.length == 4


@pytest.mark.parametrize("model_type, layer_kind",
                         [("jamba", "linear_attention"), ("llama4_text", "chunked_attention")])
def test_layers_without_a_kv_cache_to_roll_back_are_refused_by_name(model_type, layer_kind):
    from transformers import AutoConfig

    with pytest.raises(ValueError, match=f"{model_type} has {layer_kind} layers, which accelgen cannot decode"):
        kv.new_cache(AutoConfig.for_model(model_type))


def test_a_recurrent_model_is_refused_as_hf_refuses_it_assisted_generation():
    with pytest.raises(ValueError, match="MambaForCausalLM is a recurrent"):
        ModelRunner(_tiny("mamba", hidden_size=64, num_hidden_layers=2, state_size=4))


def test_the_cache_keyword_of_each_module_kind():
    neox = _tiny("gpt_neox", **{**LLAMA_SHAPE, "num_key_value_heads": 4})
    assert kv.cache_keyword(neox) == "cache"
    assert kv.cache_keyword(neox.gpt_neox.layers[0].attention) == "layer_past"
