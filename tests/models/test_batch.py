"""A batched forward over ragged caches and blocks equals each sequence's own forward."""

import pytest
import torch

from accelgen import cache as kv
from accelgen.draft import tree_attention
from accelgen.models.batch import batched_forward
from accelgen.models.runner import ModelRunner


def runner_after(model, prompt: list[int]) -> ModelRunner:
    runner = ModelRunner(model)
    if prompt:
        runner.forward(torch.tensor(prompt), logits_for_last=1)
    return runner


def assert_same_cache(a: ModelRunner, b: ModelRunner):
    assert a.length == b.length
    for layer_a, layer_b in zip(a.cache.layers, b.cache.layers):
        torch.testing.assert_close(layer_a.keys, layer_b.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(layer_a.values, layer_b.values, atol=1e-5, rtol=1e-4)


TREE = tree_attention(torch.tensor([-1, 0, -1, 2]), prefix=1)  # root, two branches of depth 2


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_batched_forward_equals_separate_forwards(make_tiny_model, kind):
    model = make_tiny_model(kind)
    prompts = [[5, 17, 923, 4410, 77, 12, 9], [3, 8], [], [40, 41, 42, 43]]
    blocks = [
        (torch.tensor([12, 31, 7]), None, 3),  # a root + 2-token chain draft
        (torch.tensor([99]), None, 1),  # a plain decode step
        (torch.tensor([1, 5, 6, 7, 8, 9]), None, 1),  # a whole prompt (prefill), logits for its last token only
        (torch.tensor([44, 10, 11, 12, 13]), TREE, 5),  # a token tree
    ]
    alone = [runner_after(model, p) for p in prompts]
    batched = [runner_after(model, p) for p in prompts]
    expected = [runner.forward(*block) for runner, block in zip(alone, blocks)]
    got = batched_forward(batched, blocks)
    for want, have, a, b in zip(expected, got, alone, batched):
        assert have.shape == want.shape
        torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)
        assert_same_cache(a, b)
    # caches stay usable for ragged roll-back and another batched step
    batched[0].keep(len(prompts[0]), [0, 1])
    alone[0].keep(len(prompts[0]), [0, 1])
    batched[3].keep(len(prompts[3]), [0, 3, 4])
    alone[3].keep(len(prompts[3]), [0, 3, 4])
    step = [(torch.tensor([2]), None, 1)] * 4
    for want, have in zip([r.forward(*s) for r, s in zip(alone, step)], batched_forward(batched, step)):
        torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)


def test_batch_of_one_is_the_runner_itself(tiny_target):
    runner = runner_after(tiny_target, [5, 6, 7])
    reference = runner_after(tiny_target, [5, 6, 7])
    torch.testing.assert_close(batched_forward([runner], [(torch.tensor([8, 9]), None, 2)])[0],
                               reference.forward(torch.tensor([8, 9]), logits_for_last=2))


def test_stack_and_split_round_trip(tiny_target):
    runners = [runner_after(tiny_target, p) for p in ([1, 2, 3, 4], [5])]
    stacked = kv.stack_left_padded([r.cache for r in runners], [4, 1], tiny_target.config)
    assert stacked.layers[0].keys.shape[0] == 2 and kv.cache_length(stacked) == 4
    assert stacked.layers[0].keys[1, :, :3].abs().sum() == 0  # the padding in front of the short row
    row = kv.row_of(stacked, 1, [(3, 4)], tiny_target.config)
    torch.testing.assert_close(row.layers[1].keys, runners[1].cache.layers[1].keys)


def test_forward_together_equals_forward_alone(make_tiny_model, monkeypatch):
    from accelgen.models import batch
    from accelgen.models.batch import forward_alone, forward_together

    model, other = make_tiny_model("qwen2"), make_tiny_model("llama", seed=3)

    def greedy_steps(runner, prompt, count):  # a little drafter: `count` greedy tokens, one forward each
        tokens = []
        logits = yield runner, torch.tensor(prompt)
        for _ in range(count):
            tokens.append(int(logits.argmax()))
            logits = yield runner, torch.tensor(tokens[-1:])
        return tokens

    def broken(runner):
        yield runner, torch.tensor([1, 2])
        raise RuntimeError("drafter broke")

    wide = list(range(20, 21 + batch.WIDEST_SHARED_BLOCK))  # a prompt to catch up on, wider than most: alone
    jobs = [(model, [5, 6, 7], 4), (model, [9], 1), (other, [3, 4], 3), (model, [11, 12, 13, 14], 0), (model, wide, 2)]
    alone = [forward_alone(greedy_steps(ModelRunner(m), p, n)) for m, p, n in jobs]
    widths = []
    real_batched_forward = batch.batched_forward
    monkeypatch.setattr(batch, "batched_forward", lambda runners, blocks: widths.append([len(b[0]) for b in blocks])
                        or real_batched_forward(runners, blocks))
    together = forward_together([greedy_steps(ModelRunner(m), p, n) for m, p, n in jobs] + [broken(ModelRunner(model))])
    assert together[:5] == alone and [len(tokens) for tokens in alone] == [4, 1, 3, 0, 2]
    assert isinstance(together[5], RuntimeError)
    assert [len(wide)] in widths and all(len(w) == 1 for w in widths if len(wide) in w)  # never padded into a batch


def test_a_runner_with_its_own_forward_is_not_batched(make_tiny_model):
    """An early-exit runner decodes through its own walk even when the server batches it with others."""
    from accelgen.exits.calm import make_rule
    from accelgen.models.early_exit import EarlyExitRunner

    model = make_tiny_model("qwen2", layers=3)
    exiting = [EarlyExitRunner(model, make_rule(model, measure="softmax", threshold=0.0, exit_layers=[0]))
               for _ in range(2)]
    plain = [runner_after(model, [5, 6, 7]) for _ in range(2)]
    for runner in exiting:
        runner.forward(torch.tensor([5, 6, 7]))
    block = (torch.tensor([8]), None, 1)
    together = batched_forward([exiting[0], plain[0]], [block, block])
    torch.testing.assert_close(together[0], exiting[1].forward(*block))
    torch.testing.assert_close(together[1], plain[1].forward(*block))
    assert exiting[0].layers_used == [1]


def test_a_runner_keeping_hidden_states_forwards_alone_and_keeps_them(make_tiny_model):
    """Medusa's drafter reads the target's last hidden states: its runner keeps them, also inside a batch."""
    model = make_tiny_model("qwen2")
    keeping, plain, reference = (runner_after(model, [5, 6, 7]) for _ in range(3))
    keeping.keep_hidden = True
    block = (torch.tensor([8, 9]), None, 2)
    together = batched_forward([keeping, plain], [block, block])
    torch.testing.assert_close(together[0], reference.forward(*block))
    torch.testing.assert_close(together[1], together[0])
    assert keeping.hidden.shape == (2, 64) and plain.hidden is None
    with torch.inference_mode():
        torch.testing.assert_close(model.lm_head(keeping.hidden).float(), together[0])
