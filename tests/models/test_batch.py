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


def assert_same_cache(a: ModelRunner, b: ModelRunner, assert_reordered):
    assert a.length == b.length
    for layer_a, layer_b in zip(a.cache.layers, b.cache.layers):
        assert_reordered(layer_b.keys, layer_a.keys)  # a batched forward sums in another order than a single one
        assert_reordered(layer_b.values, layer_a.values)


TREE = tree_attention(torch.tensor([-1, 0, -1, 2]), prefix=1)  # root, two branches of depth 2


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_batched_forward_equals_separate_forwards(make_tiny_model, kind, assert_reordered):
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
        assert_reordered(have, want)
        assert_same_cache(a, b, assert_reordered)
    # caches stay usable for ragged roll-back and another batched step
    batched[0].keep(len(prompts[0]), [0, 1])
    alone[0].keep(len(prompts[0]), [0, 1])
    batched[3].keep(len(prompts[3]), [0, 3, 4])
    alone[3].keep(len(prompts[3]), [0, 3, 4])
    step = [(torch.tensor([2]), None, 1)] * 4
    for want, have in zip([r.forward(*s) for r, s in zip(alone, step)], batched_forward(batched, step)):
        assert_reordered(have, want)


def test_batch_of_one_is_the_runner_itself(tiny_target, assert_reordered, monkeypatch):
    """A batch of one sequence is handed to its runner's own forward; the batched path it skips gives the same
    logits and cache for rows without padding (two equal sequences sharing one forward)."""
    block = (torch.tensor([8, 9]), None, 2)
    reference = runner_after(tiny_target, [5, 6, 7])
    expected = reference.forward(*block)
    runner = runner_after(tiny_target, [5, 6, 7])
    calls = []
    own_forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda *args: calls.append(args) or own_forward(*args))
    [alone] = batched_forward([runner], [block])
    assert calls == [block]
    torch.testing.assert_close(alone, expected)
    pair = [runner_after(tiny_target, [5, 6, 7]) for _ in range(2)]
    for logits, batched in zip(batched_forward(pair, [block, block]), pair):
        assert logits.shape == expected.shape
        assert_reordered(logits, expected)
        assert_same_cache(reference, batched, assert_reordered)


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


# Several requests of different lengths, decoded greedily: their prompts prefilled in one batched forward, then one
# token each per batched forward, against each request alone. Each step feeds both runs the token the request
# alone chose, so that both always see the same context and every step's logits can be compared.
PROMPTS = [[5, 17, 923, 4410, 77, 12, 9], [3, 8], [40, 41, 42, 43], [7]]


def decode_batched_and_alone(model, steps: int = 12):
    """[(alone logits, batched logits)] per request, one (vocab,) pair per step."""
    alone, batched = [ModelRunner(model) for _ in PROMPTS], [ModelRunner(model) for _ in PROMPTS]
    blocks = [(torch.tensor(prompt), None, 1) for prompt in PROMPTS]
    pairs = [[] for _ in PROMPTS]
    for _ in range(steps):
        for row, (one, together) in enumerate(zip([r.forward(*b) for r, b in zip(alone, blocks)],
                                                   batched_forward(batched, blocks))):
            pairs[row].append((one[-1], together[-1]))
        blocks = [(request[-1][0].argmax().reshape(1), None, 1) for request in pairs]
    return pairs


def test_batched_fp32_decoding_is_token_identical_to_each_request_alone(make_tiny_model, assert_reordered):
    for one, together in [pair for request in decode_batched_and_alone(make_tiny_model("qwen2")) for pair in request]:
        assert int(together.argmax()) == int(one.argmax())
        assert_reordered(together, one)


def test_batched_bf16_decoding_differs_from_alone_only_at_near_ties(make_tiny_model, assert_reordered):
    """bf16 rounds each layer's output to 8 significant bits, and a batched forward sums in another order than a
    single one: the logits agree up to that rounding, so the greedy token is the same unless the best two logits
    are that close. Such a token counts as a near-tie in the benchmark's audit (accelgen/bench/audit.py)."""
    from accelgen.bench.audit import classify

    model = make_tiny_model("qwen2").to(torch.bfloat16)
    for request in decode_batched_and_alone(model):
        for step, (one, together) in enumerate(request):
            assert_reordered(together, one, torch.bfloat16)
            token, alone_token = int(together.argmax()), int(one.argmax())
            if token != alone_token:
                assert classify(one, step, alone_token, token, torch.bfloat16).classification == "near-tie"
