"""Shared by the drafter tests: cached greedy references, a lossless check that explains a mismatch, a tiny
model that falls into a cycle, a SmolLM2 copy task, a check that sampling keeps the target distribution, and
BiTA/SPACE drafts forced right or wrong."""

from __future__ import annotations

import math

import pytest
import torch

import accelgen
from accelgen.prompts import encode_prompt

CYCLE_SEED_PROMPT = [5, 17, 23, 41, 7, 12]


@pytest.fixture(scope="session")
def code():
    return "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"


@pytest.fixture(scope="session")
def copy_prompt(code):
    """The copy task for SmolLM2: the answer repeats the prompt's code, so copy-based drafts get accepted."""
    return [{"role": "user", "content": "Repeat this Python code exactly, then explain it in one sentence.\n\n" + code}]


@pytest.fixture(scope="session")
def assert_lossless(greedy):
    """assert_lossless(model, tokenizer, prompt, method, max_new_tokens, **options) -> the method's result,
    after checking its tokens equal greedy decoding's; a mismatch reports the first differing position and
    the baseline's top-2 logit margin there, to tell a numerical tie from a bug."""

    def check(model, tokenizer, prompt, method, max_new_tokens, **options):
        expected = greedy(model, tokenizer, prompt, max_new_tokens)
        result = accelgen.generate(model, tokenizer, prompt, method=method, max_new_tokens=max_new_tokens, **options)
        if result.token_ids != expected.token_ids:
            pytest.fail(_describe_mismatch(model, tokenizer, prompt, expected.token_ids, result.token_ids, method))
        return result

    return check


def _describe_mismatch(model, tokenizer, prompt, expected, got, method) -> str:
    first = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    context = encode_prompt(tokenizer, prompt) + expected[:first]
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0, -1].float()
    top2 = logits.topk(2).values
    return (f"{method} differs from greedy at new token {first}: expected {expected[first:first + 3]}, got "
            f"{got[first:first + 3]}; baseline top-2 logit margin there {float(top2[0] - top2[1]):.2e}")


@pytest.fixture(scope="session")
def cycling_model(make_tiny_model):
    """A tiny model whose attention output is zeroed: a token's logits depend on that token alone, so greedy
    decoding falls into a short cycle (period 6 from the third token, for this seed and CYCLE_SEED_PROMPT)."""
    model = make_tiny_model("qwen2", seed=0, vocab_size=1024)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return model


@pytest.fixture(scope="session")
def cycle_prompt(cycling_model, tokenizer, greedy):
    """A prompt that contains its own continuation: CYCLE_SEED_PROMPT and the first 20 tokens the cycling model
    generates after it (two and a half turns of the cycle)."""
    return CYCLE_SEED_PROMPT + greedy(cycling_model, tokenizer, CYCLE_SEED_PROMPT, 20).token_ids


# --- sampling ------------------------------------------------------------------------------------------

SAMPLING_VOCAB = 8
SAMPLING_TOKENS = 3
SAMPLING_RUNS = 1500
ENDED = SAMPLING_VOCAB  # the "category" of a position after EOS ended the sequence


@pytest.fixture(scope="session")
def sampling_model(make_tiny_model):
    """A tiny model over 8 tokens (EOS = 2), so exact sequence probabilities can be enumerated."""
    return make_tiny_model("qwen2", seed=3, vocab_size=SAMPLING_VOCAB)


def exact_position_marginals(model, prompt: list[int], eos: int = 2) -> torch.Tensor:
    """(SAMPLING_TOKENS, SAMPLING_VOCAB + 1): the target's law of each new token (last column: already ended),
    by enumerating every continuation at temperature 1."""
    marginals = torch.zeros(SAMPLING_TOKENS, SAMPLING_VOCAB + 1, dtype=torch.float64)
    paths = [([], 1.0)]  # unfinished continuations and their probabilities
    for position in range(SAMPLING_TOKENS):
        batch = torch.tensor([prompt + path for path, _ in paths])
        with torch.no_grad():
            probs = torch.softmax(model(batch).logits[:, -1].double(), dim=-1)
        next_paths = []
        for (path, weight), row in zip(paths, probs):
            for token in range(SAMPLING_VOCAB):
                mass = weight * float(row[token])
                marginals[position, token] += mass
                if token != eos:
                    next_paths.append((path + [token], mass))
                else:
                    marginals[position + 1 :, ENDED] += mass
        paths = next_paths
    return marginals


@pytest.fixture(scope="session")
def assert_samples_target(sampling_model, tokenizer):
    """assert_samples_target(method, prompt, **options): sampled at temperature 1 with many seeds, each of the
    first three new tokens follows the target's exact law (total variation within a bound that a correct
    sampler exceeds with probability < 1e-3), and the drafts were neither never nor always accepted. 1,500
    generations: the tests that call it are marked slow (`pytest -m slow`), and CI runs them after the default run."""

    def check(method, prompt, **options):
        exact = exact_position_marginals(sampling_model, prompt)
        counts = torch.zeros_like(exact)
        accepted = drafted = 0
        for seed in range(SAMPLING_RUNS):
            result = accelgen.generate(sampling_model, tokenizer, prompt, method=method, temperature=1.0, seed=seed,
                                       max_new_tokens=SAMPLING_TOKENS, **options)
            tokens = result.token_ids + [ENDED] * (SAMPLING_TOKENS - len(result.token_ids))
            for position, token in enumerate(tokens):
                counts[position, token] += 1
            accepted += result.stats["accepted_draft_tokens"]
            drafted += result.stats["draft_tokens"]
        bound = 0.5 * math.sqrt((SAMPLING_VOCAB + 1) / SAMPLING_RUNS) + math.sqrt(math.log(1e3) / (2 * SAMPLING_RUNS))
        for position in range(SAMPLING_TOKENS):
            distance = 0.5 * float((counts[position] / SAMPLING_RUNS - exact[position]).abs().sum())
            assert distance < bound, f"new token {position}: total variation {distance:.3f} > {bound:.3f}"
        assert 0 < accepted < drafted, f"drafts must be tested both ways: {accepted} of {drafted} accepted"

    return check


@pytest.fixture(scope="session")
def sampling_draft(make_tiny_model):
    """A draft model for sampling_model: another tiny model over the same 8 tokens."""
    return make_tiny_model("llama", seed=4, vocab_size=SAMPLING_VOCAB)




@pytest.fixture
def mask_oracle(monkeypatch):
    """mask_oracle(reference, prompt_length, wrong_from): MaskDrafter (BiTA, SPACE) proposes the true
    continuation (its masks' rows still read, then overridden), wrong from index wrong_from on (None: all right;
    0: none right)."""
    from accelgen.draft import Draft
    from accelgen.drafters.mask_drafting import MaskDrafter

    original = MaskDrafter.propose

    def force(reference: list[int], prompt_length: int, wrong_from: int | None) -> None:
        def propose(self, context, max_nodes):
            original(self, context, max_nodes)
            done = len(context) - prompt_length
            truth = torch.tensor(reference[done : done + self.masks], dtype=torch.long)
            if wrong_from is not None:
                truth[wrong_from:] = (truth[wrong_from:] + 1) % 1000
            return Draft.chain(truth).truncated(max_nodes)

        monkeypatch.setattr(MaskDrafter, "propose", propose)

    return force
