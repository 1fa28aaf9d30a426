"""The loop: lossless against greedy decoding (fp32), stopping rules, edge cases and errors."""

import copy
import importlib
from dataclasses import dataclass, field

import pytest
import torch

import accelgen
from accelgen.draft import ROOT, Draft, Verdict
from accelgen.prompts import encode_prompt, eos_token_ids
from accelgen.drafters.base import Drafter
from accelgen.registry import MethodOptions, MethodSpec, Part
from accelgen.sampling import logits_to_probs

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
    def make(build, options):
        return OracleTreeDrafter(options.continuation, options.prompt_length)

    spec = MethodSpec("oracle-tree", "test", "greedy-exact", "-", "test drafter", Part(make, OracleOptions))
    monkeypatch.setitem(accelgen.registry._METHODS, spec.name, spec)  # removed again after the test


@dataclass(frozen=True)
class OracleOptions(MethodOptions):
    continuation: list = field(default_factory=list)
    prompt_length: int = 0


class OracleTreeDrafter(Drafter):
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
@pytest.mark.parametrize("gamma", [1, 3, pytest.param(8, marks=pytest.mark.slow)])  # 8: the longest drafts, slow
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

    def always_accept(draft, logits, sampling, first_position):  # seeded sampling verifies per position (verify_gumbel)
        return Verdict(list(range(len(draft))), int(torch.multinomial(logits_to_probs(logits[-1], sampling), 1)))

    monkeypatch.setattr(importlib.import_module("accelgen.loop"), "verify_gumbel", always_accept)
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
    no_bos = copy.deepcopy(tokenizer)  # a shallow copy shares (and would clear) the fixture's BOS
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
    with pytest.raises(ValueError, match="gamma must be an integer >= 1 or 'auto', got 0"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="speculative", draft_model=tiny_target, gamma=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=-1)


def test_a_two_row_tensor_is_two_prompts(tiny_target, tokenizer, tiny_greedy):
    """It used to be flattened into one prompt."""
    other = [7, 300, 12]
    results = accelgen.generate(tiny_target, tokenizer, torch.tensor([PROMPT, other + other]), max_new_tokens=4)
    assert [result.token_ids for result in results] == [tiny_greedy[:4], hf_greedy(tiny_target, other + other, 4)]
    with pytest.raises(ValueError, match=r"shape \(1, 1, 6\), not \(L,\) or \(batch, L\)"):
        accelgen.generate(tiny_target, tokenizer, torch.tensor([[PROMPT]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="one prompt is expected here.*list of prompts"):
        encode_prompt(tokenizer, [PROMPT, PROMPT[:3]])


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
    ({"method": "speculative", "gamma": "five"}, "gamma must be an integer >= 1 or 'auto', got 'five'"),
    ({"method": "speculative", "gamma": 2.5}, "speculative: gamma must be text or an integer, got 2.5"),
    ({"method": "specdec", "tau": float("nan")}, "specdec: tau must be a finite number, got nan"),
])
def test_arguments_of_the_wrong_type_are_named(tiny_target, tokenizer, arguments, message):
    with pytest.raises(ValueError, match=message):
        accelgen.generate(tiny_target, tokenizer, PROMPT, draft_model=tiny_target, **arguments)


def test_whole_numbers_pass_as_floats(tiny_target, tokenizer, tiny_greedy):
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=3, temperature=0, top_p=1, seed=3)
    assert result.token_ids == tiny_greedy[:3]


# --- transformers' settings: GenerationConfig, model.generation_config, HF's names ----------------------------


def with_generation_config(model, **fields):
    model = copy.deepcopy(model)
    for name, value in fields.items():
        setattr(model.generation_config, name, value)
    return model


def test_settings_precedence_argument_then_config_then_model_then_accelgen(tiny_target, tokenizer):
    from transformers import GenerationConfig

    model = with_generation_config(tiny_target, max_new_tokens=3)  # used to be ignored: 128 tokens
    assert len(accelgen.generate(model, tokenizer, PROMPT).token_ids) == 3
    assert len(accelgen.generate(model, tokenizer, PROMPT, generation_config=GenerationConfig(max_new_tokens=5)).token_ids) == 5
    assert len(accelgen.generate(model, tokenizer, PROMPT, generation_config=GenerationConfig(max_new_tokens=5),
                                 max_new_tokens=6).token_ids) == 6
    assert len(accelgen.generate(tiny_target, tokenizer, PROMPT, max_length=len(PROMPT) + 2).token_ids) == 2
    assert len(accelgen.generate(tiny_target, tokenizer, PROMPT, max_length=9, max_new_tokens=4).token_ids) == 4
    with pytest.raises(ValueError, match="max_length=4 .* shorter than the 6-token prompt"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, max_length=4)
    with pytest.raises(ValueError, match="generation_config must be a transformers GenerationConfig, not dict"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, generation_config={"max_new_tokens": 3})


def test_do_sample_and_temperature_as_transformers_reads_them(tiny_target, tokenizer, tiny_greedy):
    sampled = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=8, temperature=0.7, seed=3).token_ids
    assert sampled != tiny_greedy[:8]
    sampling_model = with_generation_config(tiny_target, do_sample=True, temperature=0.7)
    assert accelgen.generate(sampling_model, tokenizer, PROMPT, max_new_tokens=8, seed=3).token_ids == sampled
    for greedy in (dict(temperature=0), dict(do_sample=False)):  # an argument wins over the model's config
        assert accelgen.generate(sampling_model, tokenizer, PROMPT, max_new_tokens=8, **greedy).token_ids == tiny_greedy[:8]
    assert accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=8, do_sample=True, temperature=0.7,
                             seed=3).token_ids == sampled
    # a temperature in a config without do_sample is greedy, as in transformers
    from transformers import GenerationConfig

    assert accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=8,
                             generation_config=GenerationConfig(temperature=0.7)).token_ids == tiny_greedy[:8]
    with pytest.raises(ValueError, match="do_sample=True needs temperature > 0"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, do_sample=True, temperature=0)


@pytest.mark.parametrize("source", ["argument", "generation_config", "model.generation_config"])
def test_settings_accelgen_cannot_honour_are_errors(tiny_target, tokenizer, source):
    from transformers import GenerationConfig

    model, arguments = tiny_target, {}
    if source == "argument":
        arguments = {"num_beams": 4}
    elif source == "generation_config":
        arguments = {"generation_config": GenerationConfig(num_beams=4)}
    else:
        model = with_generation_config(tiny_target, num_beams=4)
    with pytest.raises(ValueError, match=f"cannot honour num_beams=4 \\(from {source}\\): beam search"):
        accelgen.generate(model, tokenizer, PROMPT, max_new_tokens=2, **arguments)
    # the neutral value passes, and so do settings that change nothing in the output
    assert accelgen.generate(model, tokenizer, PROMPT, max_new_tokens=2, num_beams=1, use_cache=True).token_ids


@pytest.mark.parametrize("arguments, message", [
    ({"num_return_sequences": 2}, "num_return_sequences=2.*own seed"),
    ({"min_length": 9}, "min_length=9.*min_new_tokens"),
    ({"typical_p": 0.9}, "typical_p=0.9.*temperature, top_k and top_p"),
    ({"num_assistant_tokens": 3}, "num_assistant_tokens sets gamma, an option method 'autoregressive' does not have"),
    ({"method": "layerskip", "num_assistant_tokens_schedule": "heuristic_transient"},
     "num_assistant_tokens_schedule='heuristic_transient'"),
    ({"method": "speculative", "max_matching_ngram_size": 2}, "sets max_ngram, an option method 'speculative'"),
    ({"assistant_model": "draft", "prompt_lookup_num_tokens": 3}, "choose two methods"),
    ({"stopping_criteria": ["x"]}, "use stop="),
])
def test_transformers_names_without_an_equivalent_name_what_to_use(tiny_target, tokenizer, arguments, message):
    with pytest.raises(ValueError, match=message):
        accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=2, **arguments)


def test_transformers_names_are_aliases(tiny_target, tiny_draft, tokenizer, tiny_greedy):
    assisted = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=12, assistant_model=tiny_target,
                                 num_assistant_tokens=3)  # speculative with gamma 3: every draft accepted
    assert assisted.token_ids == tiny_greedy[:12] and assisted.stats["accepted_per_step"] == [3, 3, 3]
    heuristic = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=12, assistant_model=tiny_target,
                                  num_assistant_tokens=2, num_assistant_tokens_schedule="heuristic")
    assert heuristic.token_ids == tiny_greedy[:12] and heuristic.stats["accepted_per_step"][:2] == [2, 4]
    repeating = ROWS[2]  # prompt lookup finds its n-grams
    lookup = accelgen.generate(tiny_target, tokenizer, repeating, max_new_tokens=12, prompt_lookup_num_tokens=4,
                               max_matching_ngram_size=2)
    pld = accelgen.generate(tiny_target, tokenizer, repeating, method="pld", max_new_tokens=12, draft_length=4,
                            max_ngram=2)
    assert lookup.token_ids == pld.token_ids == hf_greedy(tiny_target, repeating, 12)
    assert lookup.stats["draft_tokens"] == pld.stats["draft_tokens"] > 0
    eos = tiny_greedy[first_new_position(tiny_greedy, 2)]
    ended = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=12, eos_token_id=eos)
    assert ended.token_ids == tiny_greedy[: tiny_greedy.index(eos) + 1] and ended.finish_reason == "stop"
    with pytest.raises(ValueError, match="'num_assistant_tokens' is transformers' name: use gamma"):
        accelgen.get_method("speculative").check_options({"num_assistant_tokens": 3})  # e.g. CLI -o


def test_stop_strings_is_stop(smollm):
    model, tokenizer = smollm
    plain = accelgen.generate(model, tokenizer, REAL_PROMPTS["prose"], max_new_tokens=20)
    word = plain.text.split()[3]
    result = accelgen.generate(model, tokenizer, REAL_PROMPTS["prose"], max_new_tokens=20, stop_strings=word)
    assert result.finish_reason == "stop" and result.text == plain.text[: plain.text.index(word)]


def test_repetition_penalty_from_the_model_config(tiny_target, tokenizer):
    penalised = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=12, repetition_penalty=1.3)
    model = with_generation_config(tiny_target, repetition_penalty=1.3)
    assert accelgen.generate(model, tokenizer, PROMPT, max_new_tokens=12).token_ids == penalised.token_ids
    assert accelgen.generate(model, tokenizer, PROMPT, max_new_tokens=12, repetition_penalty=1.0).token_ids == \
        hf_greedy(tiny_target, PROMPT, 12)


# --- transformers streamers --------------------------------------------------------------------------------


class RecordingStreamer:
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended += 1


def test_streamer_gets_the_prompt_then_each_steps_tokens(tiny_target, tokenizer, tiny_greedy):
    streamer = RecordingStreamer()
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, method="speculative", draft_model=tiny_target,
                               gamma=3, max_new_tokens=10, streamer=streamer)
    assert streamer.puts[0] == [PROMPT] and streamer.ended == 1
    assert streamer.puts[1:] == [tiny_greedy[:4], tiny_greedy[4:8], tiny_greedy[8:10]] and result.token_ids == tiny_greedy[:10]


def test_text_iterator_streamer_text_is_the_result(smollm):
    from transformers import TextIteratorStreamer

    model, tokenizer = smollm
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = accelgen.generate(model, tokenizer, REAL_PROMPTS["prose"], method="pld", max_new_tokens=24,
                               streamer=streamer)
    assert "".join(streamer) == result.text and len(result.text) > 20


# --- several prompts: batched, each row as if alone -----------------------------------------------------------


BATCH_METHODS = {
    "autoregressive": {},
    "speculative-self": {"method": "speculative", "gamma": 3, "draft": "target"},
    "speculative-random": {"method": "speculative", "gamma": 3, "draft": "random"},
    "pld": {"method": "pld"},
}
ROWS = [PROMPT, [7, 300, 12], [9, 9, 40, 41, 9, 9, 40, 41, 9, 9]]  # the last repeats itself: pld finds matches


def method_arguments(name, target, random_draft):
    arguments = dict(BATCH_METHODS[name])
    draft = arguments.pop("draft", None)
    if draft:
        arguments["draft_model"] = target if draft == "target" else random_draft
    return arguments


@pytest.mark.parametrize("name", list(BATCH_METHODS))
def test_each_prompt_of_a_list_decodes_as_if_alone(tiny_target, tiny_draft, tokenizer, name):
    arguments = method_arguments(name, tiny_target, tiny_draft)
    alone = [accelgen.generate(tiny_target, tokenizer, row, max_new_tokens=10, **arguments).token_ids for row in ROWS]
    together = accelgen.generate(tiny_target, tokenizer, ROWS, max_new_tokens=10, **arguments)
    assert [result.token_ids for result in together] == alone
    assert alone[0] == hf_greedy(tiny_target, PROMPT, 10)


def pad_rows(rows, pad, side):
    width = max(map(len, rows))
    padding = [[pad] * (width - len(row)) for row in rows]
    ids = [p + row if side == "left" else row + p for row, p in zip(rows, padding)]
    mask = [[0] * len(p) + [1] * len(row) if side == "left" else [1] * len(row) + [0] * len(p)
            for row, p in zip(rows, padding)]
    return torch.tensor(ids), torch.tensor(mask)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", list(BATCH_METHODS))
def test_padded_rows_with_their_mask_decode_as_if_alone(tiny_target, tiny_draft, tokenizer, name, side):
    arguments = method_arguments(name, tiny_target, tiny_draft)
    ids, mask = pad_rows(ROWS, 0, side)
    together = accelgen.generate(tiny_target, tokenizer, ids, attention_mask=mask, max_new_tokens=8, **arguments)
    assert [result.token_ids for result in together] == [
        accelgen.generate(tiny_target, tokenizer, row, max_new_tokens=8, **arguments).token_ids for row in ROWS]


def test_padding_told_by_pad_token_id_or_a_clear_error(tiny_target, tokenizer):
    ids, _ = pad_rows(ROWS[:2], 0, "left")
    alone = [accelgen.generate(tiny_target, tokenizer, row, max_new_tokens=4).token_ids for row in ROWS[:2]]
    inferred = accelgen.generate(tiny_target, tokenizer, ids, pad_token_id=0, max_new_tokens=4)
    assert [result.token_ids for result in inferred] == alone
    eos_padded, _ = pad_rows(ROWS[:2], 2, "left")  # the tiny models' pad token is their EOS
    with pytest.raises(ValueError, match="pad_token_id 2, which is also an EOS token.*pass attention_mask"):
        accelgen.generate(tiny_target, tokenizer, eos_padded, max_new_tokens=4)
    holes = torch.tensor([[5, 0, 17], [5, 17, 18]])
    with pytest.raises(ValueError, match=r"row 0: its padding \(pad_token_id 0\) is neither left nor right"):
        accelgen.generate(tiny_target, tokenizer, holes, pad_token_id=0, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"row 1: its padding \(attention_mask\)"):
        accelgen.generate(tiny_target, tokenizer, holes, attention_mask=torch.tensor([[1, 1, 1], [1, 0, 1]]))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 2\), the prompt \(2, 3\)"):
        accelgen.generate(tiny_target, tokenizer, holes, attention_mask=torch.ones(2, 2))
    with pytest.raises(ValueError, match="0 .padding. and 1 .token. only"):
        accelgen.generate(tiny_target, tokenizer, holes, attention_mask=torch.full((2, 3), 2))
    with pytest.raises(ValueError, match="take one prompt"):
        accelgen.generate(tiny_target, tokenizer, ROWS, stream=True)


def test_one_padded_row_with_its_mask_is_one_prompt(tiny_target, tokenizer, tiny_greedy):
    ids, mask = pad_rows([PROMPT, PROMPT + [1, 1]], 0, "left")
    result = accelgen.generate(tiny_target, tokenizer, ids[:1], attention_mask=mask[:1], max_new_tokens=4)
    assert result.token_ids == tiny_greedy[:4]


def test_batched_texts_and_chats(smollm):
    model, tokenizer = smollm
    prompts = [REAL_PROMPTS["prose"], REAL_PROMPTS["chat-code"]]
    together = accelgen.generate(model, tokenizer, prompts, max_new_tokens=6)
    assert [r.text for r in together] == [accelgen.generate(model, tokenizer, p, max_new_tokens=6).text for p in prompts]


def test_the_draft_budget_a_request_gets():
    from accelgen.loop import chosen_draft_budget

    speculative, pld = accelgen.get_method("speculative"), accelgen.get_method("pld")
    assert chosen_draft_budget(speculative, "auto", {}) == "measured"  # the method's default
    assert chosen_draft_budget(speculative, "auto", speculative.options) == "measured"  # every default, as the CLI's
    assert chosen_draft_budget(speculative, "auto", {"gamma": 4}) == "method"  # a fixed length
    assert chosen_draft_budget(speculative, "auto", {"gamma_schedule": "heuristic"}) == "method"
    assert chosen_draft_budget(speculative, "measured", {"gamma": 4}) == "measured"  # asked for: capped anyway
    assert chosen_draft_budget(pld, "auto", {}) == "method"
    with pytest.raises(ValueError, match="unknown draft_budget 'sometimes'; choose one of auto, method, measured"):
        chosen_draft_budget(pld, "sometimes", {})
