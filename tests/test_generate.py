"""The loop: lossless against greedy decoding (fp32), stopping rules, edge cases and errors."""

import copy
import importlib

import pytest
import torch

import accelgen
from accelgen.draft import ROOT, Draft, Verdict
from accelgen.generate import encode_prompt, eos_token_ids
from accelgen.registry import MethodSpec
from accelgen.sampling import sample

PROMPT = [5, 17, 923, 4410, 77, 12]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos=(2,)) -> list[int]:
    output = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens,
                            eos_token_id=list(eos), pad_token_id=eos[0])
    return output[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def tiny_greedy(tiny_target):
    return hf_greedy(tiny_target, PROMPT, 40)


@pytest.fixture
def oracle_method(monkeypatch):
    """Registers `oracle-tree`, a hand-built tree drafter that knows the greedy continuation (test only)."""
    from accelgen import registry

    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))

    def make(target_model, *, continuation, prompt_length, **_):
        return OracleTreeDrafter(continuation, prompt_length)

    registry.register(MethodSpec("oracle-tree", "test", "greedy-exact", "-", "test drafter", make,
                                 options={"continuation": [], "prompt_length": 0}))


class OracleTreeDrafter:
    """Drafts a tree whose correct branch is not the first child, so the commit must gather-compact the cache:

        root ─ wrong(0) ─ right+1(1)
             └ right(2) ─ wrong+1(3)
                        └ right+1(4) ─ right+2(5)
    """

    def __init__(self, continuation, prompt_length):
        self.continuation, self.prompt_length = continuation, prompt_length
        self.accepted = []

    def propose(self, context, max_nodes):
        done = len(context) - self.prompt_length
        right = self.continuation[done:done + 3]
        if len(right) < 3:
            return Draft.empty()
        wrong = [(t + 1) % 1000 for t in right]
        draft = Draft(torch.tensor([wrong[0], right[1], right[0], wrong[1], right[1], right[2]]),
                      torch.tensor([ROOT, 0, ROOT, 2, 2, 4]))
        return draft.truncated(max_nodes)

    def update(self, draft, verdict, target_logits):
        self.accepted.append(verdict.accepted)


# --- lossless: identical to greedy decoding --------------------------------------------------------------


def test_autoregressive_matches_hf_greedy(tiny_target, tokenizer, tiny_greedy):
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=40)
    assert result.token_ids == tiny_greedy
    assert result.stats["target_forwards"] == 40 and result.stats["mean_accepted_tokens"] == 1.0


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_self_draft_accepts_everything(tiny_target, tokenizer, tiny_greedy, gamma):
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, method="speculative", draft_model=tiny_target,
                               max_new_tokens=40, gamma=gamma)
    assert result.token_ids == tiny_greedy
    assert result.stats["acceptance_rate"] == 1.0
    # every full step commits gamma + 1 tokens; only the last, cut by max_new_tokens, may commit fewer
    assert result.stats["accepted_per_step"][:-1] == [gamma] * (len(result.stats["accepted_per_step"]) - 1)
    assert result.stats["target_forwards"] == -(-40 // (gamma + 1))


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_random_draft_accepts_nothing_and_changes_nothing(tiny_target, tiny_draft, tokenizer, tiny_greedy, gamma):
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, method="speculative", draft_model=tiny_draft,
                               max_new_tokens=40, gamma=gamma)
    assert result.token_ids == tiny_greedy
    assert result.stats["accepted_draft_tokens"] == 0 and result.stats["target_forwards"] == 40


def test_tree_draft_commits_through_gather_compact(tiny_target, tokenizer, tiny_greedy, oracle_method):
    continuation = hf_greedy(tiny_target, PROMPT, 50)
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, method="oracle-tree", max_new_tokens=40,
                               continuation=continuation, prompt_length=len(PROMPT))
    assert result.token_ids == tiny_greedy
    # every full step accepts the second branch: nodes 2, 4, 5, then the bonus token
    assert result.stats["accepted_per_step"][:5] == [3] * 5
    assert result.stats["mean_accepted_tokens"] > 3.0


def shallow_copy(dtype: str, layers: int):
    """SmolLM2 with only its first `layers` of 30 layers: a draft that is right often, but not always."""
    model = accelgen.load_model("smollm2-135m", dtype=dtype)[0]
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    return model


@pytest.fixture(scope="module")
def smollm_shallow():
    return shallow_copy("float32", 20)


REAL_PROMPTS = {
    "chat-code": [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
    "prose": "The three most important ideas in the history of science are",
}


@pytest.fixture(scope="module")
def real_greedy(smollm):
    """prompt name -> (prompt ids, HF greedy continuation of 40 tokens) on fp32 SmolLM2."""
    model, tokenizer = smollm
    expected = {}
    for name, prompt in REAL_PROMPTS.items():
        prompt_ids = encode_prompt(tokenizer, prompt)
        expected[name] = prompt_ids, hf_greedy(model, prompt_ids, 40, eos=sorted(eos_token_ids(model, tokenizer)))
    return expected


def test_real_model_autoregressive_matches_hf(smollm, real_greedy):
    model, tokenizer = smollm
    for prompt_ids, expected in real_greedy.values():
        assert accelgen.generate(model, tokenizer, prompt_ids, max_new_tokens=40).token_ids == expected


@pytest.mark.parametrize("prompt", list(REAL_PROMPTS))
@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_real_model_partial_acceptance_is_lossless(smollm, smollm_shallow, real_greedy, prompt, gamma):
    model, tokenizer = smollm
    prompt_ids, expected = real_greedy[prompt]
    result = accelgen.generate(model, tokenizer, prompt_ids, method="speculative", draft_model=smollm_shallow,
                               max_new_tokens=40, gamma=gamma)
    assert result.token_ids == expected
    assert 0.0 < result.stats["acceptance_rate"] < 1.0
    assert result.stats["target_forwards"] < len(expected)


def test_draft_in_another_dtype_is_lossless(smollm, real_greedy):
    """A bf16 draft for an fp32 target (logits compared in fp32)."""
    model, tokenizer = smollm
    prompt_ids, expected = real_greedy["chat-code"]
    result = accelgen.generate(model, tokenizer, prompt_ids, method="speculative", draft_model=shallow_copy("bfloat16", 20),
                               max_new_tokens=12, gamma=4)
    assert result.token_ids == expected[:12]
    assert result.stats["accepted_draft_tokens"] > 0


@pytest.mark.parametrize("schedule", ["heuristic", "cost"])
def test_gamma_schedules_are_lossless(smollm, smollm_shallow, real_greedy, schedule):
    model, tokenizer = smollm
    prompt_ids, expected = real_greedy["chat-code"]
    for draft_model in (smollm_shallow, model):  # mostly rejected, then always accepted
        dynamic = accelgen.generate(model, tokenizer, prompt_ids, method="speculative", draft_model=draft_model,
                                    max_new_tokens=40, gamma=2, gamma_schedule=schedule)
        assert dynamic.token_ids == expected
    if schedule == "heuristic":  # ("cost" depends on measured times)
        assert max(dynamic.stats["accepted_per_step"]) > 2  # full acceptance grew gamma past its start


# --- stopping: EOS, stop strings, max_new_tokens --------------------------------------------------------


def with_eos(model, eos_token: int):
    model = copy.deepcopy(model)
    model.generation_config.eos_token_id = eos_token
    return model


def first_new_position(tokens: list[int], start: int) -> int:
    """A position >= start whose token does not occur earlier, so an EOS there is the first EOS."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_eos_inside_an_accepted_draft_ends_generation_there(tiny_target, tokenizer, tiny_greedy):
    position = first_new_position(tiny_greedy, 2)
    model = with_eos(tiny_target, tiny_greedy[position])
    result = accelgen.generate(model, tokenizer, PROMPT, method="speculative", draft_model=model,
                               max_new_tokens=40, gamma=8)
    assert result.token_ids == tiny_greedy[: position + 1]
    assert result.finish_reason == "stop"


def test_eos_as_bonus_token(tiny_target, tokenizer, tiny_greedy):
    gamma = first_new_position(tiny_greedy, 3)  # the first step commits tokens 0..gamma; gamma is the bonus
    model = with_eos(tiny_target, tiny_greedy[gamma])
    result = accelgen.generate(model, tokenizer, PROMPT, method="speculative", draft_model=model,
                               max_new_tokens=40, gamma=gamma)
    assert result.token_ids == tiny_greedy[: gamma + 1]
    assert result.stats["target_forwards"] == 1 and result.finish_reason == "stop"


def test_stop_string_inside_an_accepted_draft(smollm):
    model, tokenizer = smollm
    prompt = "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n"
    plain = accelgen.generate(model, tokenizer, prompt, max_new_tokens=30)
    stop = "function"  # a word in the middle of the plain output
    assert stop in plain.text, plain.text
    result = accelgen.generate(model, tokenizer, prompt, method="speculative", draft_model=model,
                               max_new_tokens=30, gamma=8, stop=[stop])
    assert result.finish_reason == "stop"
    assert result.text == plain.text[: plain.text.index(stop)]
    # generation ends with the token that completes the stop string, and nothing after it
    n = len(result.token_ids)
    assert result.token_ids == plain.token_ids[:n]
    assert stop in tokenizer.decode(result.token_ids) and stop not in tokenizer.decode(result.token_ids[:-1])


@pytest.mark.parametrize("max_new_tokens", [0, 1, 3])
def test_max_new_tokens_smaller_than_the_draft(tiny_target, tokenizer, tiny_greedy, max_new_tokens):
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, method="speculative", draft_model=tiny_target,
                               max_new_tokens=max_new_tokens, gamma=8)
    assert result.token_ids == tiny_greedy[:max_new_tokens]
    assert result.finish_reason == "length"
    assert result.stats["draft_tokens"] <= max(max_new_tokens - 1, 0)  # never drafts past the limit
    assert result.stats["target_forwards"] == min(max_new_tokens, 1)


def test_generation_stops_at_the_context_limit(make_tiny_model, tokenizer):
    model = make_tiny_model("llama", seed=3, max_positions=16)
    result = accelgen.generate(model, tokenizer, PROMPT, method="speculative", draft_model=model,
                               max_new_tokens=40, gamma=4)
    assert len(PROMPT) + len(result.token_ids) == 16 and result.finish_reason == "length"
    with pytest.raises(ValueError, match="context holds 16"):
        accelgen.generate(model, tokenizer, list(range(3, 20)), max_new_tokens=1)


def test_draft_model_with_a_shorter_context_falls_back(make_tiny_model, tiny_target, tokenizer, tiny_greedy):
    short_draft = make_tiny_model("qwen2", seed=0, max_positions=16)  # same weights as the target, 16 positions
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, method="speculative", draft_model=short_draft,
                               max_new_tokens=40, gamma=4)
    assert result.token_ids == tiny_greedy
    assert result.stats["draft_tokens"] < 16  # drafting stopped once the draft model's context was full


# --- streaming ---------------------------------------------------------------------------------------------


def test_stream_chunks_concatenate_to_the_result(smollm):
    model, tokenizer = smollm
    stream = accelgen.generate(model, tokenizer, REAL_PROMPTS["prose"], method="speculative", draft_model=model,
                               max_new_tokens=30, gamma=4, stop=["\n\n"], stream=True)
    chunks = list(stream)
    assert sum((c.token_ids for c in chunks), []) == stream.result.token_ids
    assert "".join(c.text for c in chunks) == stream.result.text
    assert len(chunks) == stream.result.stats["target_forwards"]


# --- sampling ----------------------------------------------------------------------------------------------


def test_sampling_is_reproducible_with_a_seed(tiny_target, tiny_draft, tokenizer):
    runs = [accelgen.generate(tiny_target, tokenizer, PROMPT, method="speculative", draft_model=tiny_draft,
                              max_new_tokens=20, temperature=0.8, top_p=0.9, seed=11) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids


def first_two_token_law(target, draft, tokenizer, prompt, draws):
    """Empirical joint law of the first two sampled tokens, (vocab * vocab,), from `draws` seeded generations."""
    vocab = target.config.vocab_size
    counts = torch.zeros(vocab * vocab)
    for seed in range(draws):
        tokens = accelgen.generate(target, tokenizer, prompt, method="speculative", draft_model=draft,
                                   max_new_tokens=2, temperature=1.0, seed=seed, gamma=1).token_ids
        counts[tokens[0] * vocab + tokens[1]] += 1
    return counts / draws


@pytest.fixture
def single_thread():
    """Tiny matrices: threading only adds overhead."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_speculative_sampling_end_to_end_matches_target_distribution(make_tiny_model, tokenizer, monkeypatch, single_thread):
    """The whole loop (drafting, rows of target and draft probabilities, commit) on an 8-token vocabulary: the
    first two sampled tokens follow the target's exact joint law; with an always-accepting verifier they do not."""
    vocab, prompt = 8, [3, 1, 4]
    target = make_tiny_model("qwen2", seed=5, vocab_size=vocab)
    draft = make_tiny_model("llama", seed=6, vocab_size=vocab)
    target.generation_config.eos_token_id = None  # no token ends generation early
    tokenizer = copy.deepcopy(tokenizer)  # a shallow copy shares its special tokens with the session's tokenizer
    tokenizer.eos_token = None
    with torch.no_grad():
        first = torch.softmax(target(torch.tensor([prompt])).logits[0, -1], -1)
        second = torch.stack([torch.softmax(target(torch.tensor([prompt + [t]])).logits[0, -1], -1) for t in range(vocab)])
    exact = (first[:, None] * second).flatten()

    def tv_bound(draws):
        return 0.5 * (vocab * vocab / draws) ** 0.5 + (13.8 / (2 * draws)) ** 0.5  # as in verify/test_sampling.py

    law = first_two_token_law(target, draft, tokenizer, prompt, draws=2000)
    assert 0.5 * float((law - exact).abs().sum()) < tv_bound(2000)

    always_accept = lambda draft, probs, rng: Verdict(list(range(len(draft))), sample(probs[-1], rng))  # noqa: E731
    monkeypatch.setattr(importlib.import_module("accelgen.generate"), "verify_speculative_sampling", always_accept)
    wrong_law = first_two_token_law(target, draft, tokenizer, prompt, draws=600)
    assert 0.5 * float((wrong_law - exact).abs().sum()) > 2 * tv_bound(600)


# --- prompts and errors --------------------------------------------------------------------------------


def test_prompt_forms(smollm):
    model, tokenizer = smollm
    text = "Hello there"
    ids = tokenizer(text).input_ids
    assert encode_prompt(tokenizer, text) == ids == encode_prompt(tokenizer, torch.tensor(ids))
    chat = encode_prompt(tokenizer, [{"role": "user", "content": text}])
    assert tokenizer.decode(chat).rstrip().endswith("assistant")
    with pytest.raises(TypeError, match="prompt must be"):
        encode_prompt(tokenizer, 3.5)


def test_empty_prompt_starts_from_bos_or_is_refused(smollm):
    model, tokenizer = smollm
    result = accelgen.generate(model, tokenizer, "", max_new_tokens=3)  # SmolLM2 has a BOS token
    assert len(result.token_ids) == 3
    no_bos = copy.copy(tokenizer)
    no_bos.bos_token = None
    with pytest.raises(ValueError, match="empty prompt"):
        accelgen.generate(model, no_bos, "", max_new_tokens=3)


def test_clear_errors(tiny_target, tokenizer, make_tiny_model):
    with pytest.raises(ValueError, match="unknown method 'nope'.*speculative"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="nope")
    with pytest.raises(ValueError, match="needs a draft model"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="speculative")
    other_vocab = make_tiny_model("llama", vocab_size=1000)
    with pytest.raises(ValueError, match="vocabulary"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="speculative", draft_model=other_vocab)
    with pytest.raises(ValueError, match="has no option 'gama'.*gamma"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="speculative", draft_model=tiny_target, gama=3)
    with pytest.raises(ValueError, match="gamma must be >= 1"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="speculative", draft_model=tiny_target, gamma=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=-1)


@pytest.mark.parametrize("prompt", [
    torch.tensor([PROMPT, PROMPT]), torch.tensor([[PROMPT]]), [PROMPT, PROMPT[:3]], ["Hello", "there"]])
def test_several_prompts_at_once_are_refused(tiny_target, tokenizer, prompt):
    """They used to be flattened into one prompt."""
    with pytest.raises(ValueError, match="batched prompts are not supported.*once per prompt.*accelgen serve"):
        accelgen.generate(tiny_target, tokenizer, prompt, max_new_tokens=2)


@pytest.mark.parametrize("prompt, message", [
    (torch.tensor(PROMPT) + 0.7, "must be integers, got torch.float32"), ([5.7, 17.2], "must be integers"),
    ([True, 5], "not bools"), (torch.tensor([True, False]), "must be integers, got torch.bool")])
def test_token_ids_are_not_truncated(tiny_target, tokenizer, prompt, message):
    with pytest.raises(ValueError, match=message):
        accelgen.generate(tiny_target, tokenizer, prompt, max_new_tokens=2)


def test_one_prompt_as_a_row_or_numpy_ids_is_fine(tiny_target, tokenizer, tiny_greedy):
    import numpy as np

    for prompt in (torch.tensor([PROMPT]), list(np.array(PROMPT)), tuple(PROMPT)):
        assert accelgen.generate(tiny_target, tokenizer, prompt, max_new_tokens=3).token_ids == tiny_greedy[:3]


@pytest.mark.parametrize("arguments, message", [
    ({"max_new_tokens": 3.5}, "max_new_tokens must be an integer, got 3.5"),  # used to give 4 tokens
    ({"max_new_tokens": True}, "max_new_tokens must be an integer, got True"),
    ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),  # used to sample uniformly
    ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
    ({"top_p": "0.9"}, "top_p must be a finite number, got '0.9'"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"seed": "abc"}, "seed must be an integer or None, got 'abc'"),
    ({"stop": [3]}, "stop must be a string or a list of strings"),
    ({"method": "speculative", "gamma": "five"}, "speculative: gamma must be an integer, got 'five'"),
    ({"method": "specdec", "tau": float("nan")}, "specdec: tau must be a finite number, got nan"),
])
def test_arguments_of_the_wrong_type_are_named(tiny_target, tokenizer, arguments, message):
    with pytest.raises(ValueError, match=message):
        accelgen.generate(tiny_target, tokenizer, PROMPT, draft_model=tiny_target, **arguments)


def test_whole_numbers_pass_as_floats(tiny_target, tokenizer, tiny_greedy):
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=3, temperature=0, top_p=1, seed=3)
    assert result.token_ids == tiny_greedy[:3]
