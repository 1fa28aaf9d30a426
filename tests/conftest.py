"""Shared fixtures: tiny random models built here (fast, any shape) and the real SmolLM2-135M (fp32)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import accelgen

torch.set_num_threads(2)  # the suite is sized for 2 cores


def tiny_model(kind: str = "qwen2", seed: int = 0, vocab_size: int = 49152, layers: int = 2, max_positions: int = 512):
    """A randomly initialised causal LM, fp32, with weights large enough that logits have clear argmaxes."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  initializer_range=0.2, eos_token_id=2, bos_token_id=1, pad_token_id=2)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    return model.eval()


@pytest.fixture(autouse=True, scope="session")
def fake_costs(tmp_path_factory):
    """Forward costs (accelgen/costs.py) kept in a folder of this session and timed by a fake: r(k) = 1, every
    model as fast as any other. So the draft lengths the costs decide never depend on this machine's timings or
    what it cached; tests of the policies set tables of their own (tests/test_costs.py)."""
    from accelgen import costs

    folder = tmp_path_factory.mktemp("costs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(costs, "costs_folder", lambda: folder)
        patch.setattr(costs, "time_forwards", lambda model, batch, sizes: {k: 0.01 * batch for k in sizes})
        yield


@pytest.fixture
def measured_costs(monkeypatch, tmp_path):
    """measured_costs({model: (seconds of a one-token forward, {k: r(k)})}): the forward costs every policy reads,
    as if measured so on this machine (other models: 10 ms, r(k) = 1; batches of b: b times as long), in a
    cache of this test. Models are told apart by name and shape (costs.model_key), not weight format. Returns the list of (model, batch, sizes) the fake timer was asked for."""
    from accelgen import costs
    from accelgen.profile import interpolate

    def use(tables: dict) -> list:
        measured = []
        by_key = {costs.model_key(model): table for model, table in tables.items()}  # also a model loaded again

        def timer(model, batch, sizes):
            measured.append((model, batch, list(sizes)))
            one_token, ratios = by_key.get(costs.model_key(model), (0.01, {1: 1.0}))
            return {k: batch * one_token * interpolate(ratios, k) for k in sizes}

        monkeypatch.setattr(costs, "costs_folder", lambda: tmp_path / "costs")
        monkeypatch.setattr(costs, "time_forwards", timer)
        return measured

    return use


@pytest.fixture(scope="session")
def make_tiny_model():
    """The tiny_model factory, for tests that need other shapes (import-mode=importlib: no `from conftest import`)."""
    return tiny_model


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer): the real SmolLM2-135M-Instruct in fp32."""
    return accelgen.load_model("smollm2-135m", dtype="float32")


def first_layers(model, count: int):
    """A copy of a Llama-layout model keeping only its first `count` decoder layers (a cheaper, weaker draft)."""
    model = copy.deepcopy(model)
    model.model.layers = model.model.layers[:count]
    model.config.num_hidden_layers = count
    return model


@pytest.fixture(scope="session")
def smollm_shallow(smollm):
    """A copy of SmolLM2 with only its first 20 of 30 layers: a draft model that is right often, but not always."""
    return first_layers(smollm[0], 20)


@pytest.fixture(scope="session")
def smollm_26_layers(smollm):
    """SmolLM2 without its last 4 of 30 layers: a draft model that is right often, but far from always."""
    return first_layers(smollm[0], 26)


@pytest.fixture(scope="session")
def tokenizer(smollm):
    """SmolLM2's tokenizer (vocab 49152), shared by the tiny models so that text can be decoded."""
    return smollm[1]


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_model("qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_draft():
    """An unrelated random model of the same vocabulary: its drafts are (almost) never accepted."""
    return tiny_model("llama", seed=1)


@pytest.fixture(scope="session")
def sharp_target():
    """A tiny target whose next-token distributions are peaked, as a trained LM's are (random ones are flat), so
    that a draft distilled toward it in a few steps learns something."""
    model = tiny_model("qwen2", seed=0, vocab_size=1024)
    with torch.no_grad():
        model.lm_head.weight.mul_(3)
    return model


def greedy_continuations(model, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The model's greedy continuation of each prompt, from one batched call: each row decodes as if alone
    (accelgen.generate), and a batch of 20 takes less than half the time of 20 calls."""
    return [result.token_ids for result in accelgen.generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens)]


@pytest.fixture(scope="session")
def own_continuations():
    """greedy_continuations, for the tests (import-mode=importlib: no `from conftest import`)."""
    return greedy_continuations


@pytest.fixture(scope="session")
def tiny_target_windows(tiny_target, tokenizer):
    """(20, 24) packed windows of the tiny target's own greedy continuations of 20 prompts: text that heads and
    embeddings trained in a test can learn to predict part of the time."""
    from accelgen.train.layerskip import packed_windows

    prompt = [5, 17, 923, 4410, 77, 12]
    continuations = greedy_continuations(tiny_target, tokenizer, [[start] + prompt[1:] for start in range(5, 25)], 40)
    return packed_windows(tokenizer, [tokenizer.decode(prompt + tokens) for tokens in continuations], seq_len=24,
                          count=20)


# Tolerances for two computations of the same values that sum in another order: a batched vs a single forward,
# a block vs token by token, a tree vs a chain, with vs without a KV cache. The rounding differences scale with the
# magnitude of the terms summed, not with each result (an element near zero is still a sum of terms as large as
# the others'), so the tolerance is relative to the tensor's largest magnitude:
# - float32 (eps 2^-23 ≈ 1.2e-7): a dot product of n terms summed in another order moves by ~sqrt(n)·eps relative,
#   up to n·eps, compounded over the layers: 1.6-2.8e-6 measured on the tiny models (batched vs alone decoding).
#   1e-4 leaves a wide margin for any CPU's kernels, while a real error (a wrong mask, position or cache row)
#   moves values by about the magnitude itself.
# - bfloat16 (eps 2^-8 ≈ 0.004, and every layer rounds its output to it): a one-ulp difference in a hidden state
#   reaches the logits undamped; measured 2.2-3.5 eps on the 2-layer tiny models (11 on the 30 layers of SmolLM2),
#   so 8 eps on tiny models only.
REORDERED_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 8 * 2.0 ** -8}


def assert_close_reordered(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    """actual equals expected up to the rounding of another summation order in `dtype` (the dtype the values were
    computed in; logits come back as float32 either way)."""
    tolerance = REORDERED_TOLERANCE[dtype] * float(expected.detach().abs().max())
    torch.testing.assert_close(actual, expected, rtol=0, atol=tolerance)


@pytest.fixture(scope="session")
def assert_reordered():
    """assert_close_reordered, for the tests (import-mode=importlib: no `from conftest import`)."""
    return assert_close_reordered


@pytest.fixture
def one_thread():
    """Small models run fastest on one thread, and many times faster when other processes share the cores
    (idle OpenMP threads spin); every result is compared with a baseline computed the same way. Test modules
    opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def greedy():
    """greedy(model, tokenizer, prompt, max_new_tokens): the `autoregressive` result, computed once per model
    and prompt: a shorter request gets the first tokens of a longer run (greedy output is a prefix of itself)."""
    results = {}

    def run(model, tokenizer, prompt, max_new_tokens):
        key = (id(model), repr(prompt))
        known = results.get(key)
        if known is None or (len(known.token_ids) < max_new_tokens and known.finish_reason == "length"):
            known = results[key] = accelgen.generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens)
        return dataclasses.replace(known, token_ids=known.token_ids[:max_new_tokens])

    return run
