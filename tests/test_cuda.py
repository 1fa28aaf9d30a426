"""The core methods on a CUDA device: token-for-token plain greedy decoding in fp32 with the static cache and CUDA
graphs (the default on a GPU) against the dynamic cache's eager forwards, trees included; bf16; trained-head
methods; sampling seeded and not; processors; host reads per step.

Skipped where no GPU is present (CI). On a GPU machine: `ACCELGEN_TOKENIZER=<a saved tokenizer folder of
vocabulary 49152> python -m pytest tests/test_cuda.py` (default: SmolLM2's, from the embedded model).
ACCELGEN_TEST_DEVICE=cpu runs the same checks on the CPU (to check the checks)."""

from __future__ import annotations

import os

import pytest
import torch

import accelgen
from accelgen.registry import get_method

DEVICE = os.environ.get("ACCELGEN_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = [5, 17, 923, 4410, 77, 12, 5, 17, 923]  # repeats itself, so that n-gram drafts find matches
LOSSLESS = [("speculative", {"gamma": 4}), ("specinfer", {}), ("pld", {"draft_length": 4}),
            ("trie-lookahead", {"max_nodes": 8}), ("lookahead-decoding", {"max_nodes": 8}), ("jacobi", {}),
            ("staged", {}), ("block-verify", {}), ("cascade", {})]


@pytest.fixture(scope="module")
def cuda_tokenizer():
    from transformers import AutoTokenizer

    folder = os.environ.get("ACCELGEN_TOKENIZER")
    return AutoTokenizer.from_pretrained(folder) if folder else accelgen.load_model("smollm2-135m", dtype="float32")[1]


@pytest.fixture(scope="module")
def cuda_models(make_tiny_model):
    """(target, the target again as its draft, an unrelated draft), fp32 on the GPU."""
    target = make_tiny_model("qwen2", seed=0).to(DEVICE)
    return target, target, make_tiny_model("llama", seed=1).to(DEVICE)


@pytest.mark.parametrize("method, options", LOSSLESS, ids=[name for name, _ in LOSSLESS])
@pytest.mark.parametrize("draft_index", [1, 2], ids=["self-draft", "random-draft"])
def test_greedy_exact_on_cuda(cuda_models, cuda_tokenizer, method, options, draft_index):
    target, draft = cuda_models[0], cuda_models[draft_index]
    needs_draft = "draft_model" in get_method(method).needs
    baseline = accelgen.generate(target, cuda_tokenizer, PROMPT, method="autoregressive", max_new_tokens=40,
                                 cache="dynamic")
    result = accelgen.generate(target, cuda_tokenizer, PROMPT, method=method, max_new_tokens=40,
                               draft_model=draft if needs_draft else None, **options)
    assert result.token_ids == baseline.token_ids
    assert result.stats.get("cache", "dynamic") == ("static" if DEVICE == "cuda" else "dynamic")
    if method == "speculative" and draft_index == 1:
        assert result.stats["acceptance_rate"] == 1.0  # the target drafting for itself (a chain, not a tree)


def test_sampling_with_the_target_as_draft_accepts_everything_on_cuda(cuda_models, cuda_tokenizer):
    target = cuda_models[0]
    result = accelgen.generate(target, cuda_tokenizer, PROMPT, method="speculative", draft_model=target,
                               max_new_tokens=24, temperature=1.0, seed=3, gamma=4)
    assert len(result.token_ids) == 24 and result.stats["acceptance_rate"] == 1.0


def test_server_batches_sequences_on_cuda(cuda_models, cuda_tokenizer):
    """Several sequences verified in one batched forward give what each gives alone."""
    from accelgen.models.batch import batched_forward
    from accelgen.models.runner import ModelRunner

    target = cuda_models[0]
    prompts = [PROMPT, PROMPT[:5], [9, 8, 7]]
    alone = [ModelRunner(target).forward(torch.tensor(prompt))[-1] for prompt in prompts]
    together = batched_forward([ModelRunner(target) for _ in prompts], [(torch.tensor(prompt), None, 1) for prompt in prompts])
    for logits, expected in zip(together, alone):
        torch.testing.assert_close(logits[-1], expected, atol=1e-4, rtol=1e-4)


def test_bf16_static_cache_and_graphs_match_the_dynamic_cache(make_tiny_model, cuda_tokenizer):
    """In bf16 a forward over several tokens (a padded bucket, a tree) may round differently from a one-token
    forward, so the tokens may part at a near tie: each divergence must be one (the baseline's two best logits
    within 1/8 there), and plain decoding through the graphs must not diverge at all."""
    target = make_tiny_model("qwen2", seed=0).to(DEVICE, torch.bfloat16)
    baseline = accelgen.generate(target, cuda_tokenizer, PROMPT, max_new_tokens=40, cache="dynamic").token_ids
    for method, options in [("autoregressive", {}), ("pld", {"draft_length": 4}), ("specinfer", {"draft_model": target})]:
        tokens = accelgen.generate(target, cuda_tokenizer, PROMPT, method=method, max_new_tokens=40, **options).token_ids
        if tokens != baseline:
            assert method != "autoregressive"
            first = next(i for i, (a, b) in enumerate(zip(tokens, baseline)) if a != b)
            with torch.no_grad():
                logits = target(torch.tensor([PROMPT + baseline[:first]], device=DEVICE)).logits[0, -1].float()
            best, second = logits.topk(2).values.tolist()
            assert best - second <= 0.125, f"{method} parts from plain decoding at {first}, margin {best - second}"


def test_heads_on_cuda(cuda_models, make_tiny_model, cuda_tokenizer, tmp_path):
    """Medusa and EAGLE read the runner's final hidden states, EAGLE-3 its layers' inputs, on the device."""
    from accelgen.heads.eagle import new_head
    from accelgen.heads.eagle3 import new_eagle3_head
    from accelgen.heads.medusa import MedusaHeads

    target = cuda_models[0]
    four_layers = make_tiny_model("qwen2", seed=0, layers=4).to(DEVICE)
    MedusaHeads(3, 64, 49152).save(tmp_path / "medusa")
    new_head(target).save(tmp_path / "eagle")
    new_eagle3_head(four_layers).save(tmp_path / "eagle3")
    for model, method, folder in [(target, "medusa", "medusa"), (target, "eagle", "eagle"), (four_layers, "eagle", "eagle3")]:
        baseline = accelgen.generate(model, cuda_tokenizer, PROMPT, max_new_tokens=24, cache="dynamic")
        result = accelgen.generate(model, cuda_tokenizer, PROMPT, method=method, heads=str(tmp_path / folder),
                                   max_new_tokens=24)
        assert result.token_ids == baseline.token_ids, folder


@pytest.mark.parametrize("seed", [None, 5], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("method", ["autoregressive", "pld", "speculative", "specinfer"])
def test_sampling_on_cuda(cuda_models, cuda_tokenizer, method, seed):
    target = cuda_models[0]
    needs_draft = "draft_model" in get_method(method).needs
    result = accelgen.generate(target, cuda_tokenizer, PROMPT, method=method, max_new_tokens=24, temperature=0.8,
                               top_k=20, top_p=0.9, seed=seed, draft_model=target if needs_draft else None)
    assert len(result.token_ids) == 24
    if seed is not None:  # seeded lossless sampling draws per position: the same tokens as plain sampling
        plain = accelgen.generate(target, cuda_tokenizer, PROMPT, max_new_tokens=24, temperature=0.8, top_k=20,
                                  top_p=0.9, seed=seed)
        assert result.token_ids == plain.token_ids


def test_processors_on_cuda(cuda_models, cuda_tokenizer):
    target = cuda_models[0]
    processing = dict(repetition_penalty=1.3, no_repeat_ngram_size=3, bad_words_ids=[[17]], min_new_tokens=10,
                      presence_penalty=0.5)
    baseline = accelgen.generate(target, cuda_tokenizer, PROMPT, max_new_tokens=30, cache="dynamic", **processing)
    result = accelgen.generate(target, cuda_tokenizer, PROMPT, method="pld", max_new_tokens=30, **processing)
    assert result.token_ids == baseline.token_ids and 17 not in result.token_ids


def test_grammar_on_cuda(cuda_models, cuda_tokenizer):
    pytest.importorskip("xgrammar")
    result = accelgen.generate(cuda_models[0], cuda_tokenizer, "Answer in JSON:", method="pld", max_new_tokens=40,
                               response_format={"type": "json_object"})
    assert result.text.lstrip()[:1] in ("{", "[")  # a JSON value's start (json_object allows arrays)


@pytest.mark.parametrize("method, options, bound", [("autoregressive", {}, 1), ("pld", {"draft_length": 4}, 1),
                                                    ("speculative", {"gamma": 4}, 2)])
def test_host_reads_per_step_on_cuda(cuda_models, cuda_tokenizer, method, options, bound):
    """Counted by torch's sync debug mode on CUDA (every synchronizing call: reads and blocking copies alike)."""
    from accelgen.host_reads import count_host_reads

    target = cuda_models[0]
    if "draft_model" in get_method(method).needs:
        options = {**options, "draft_model": target}
    accelgen.generate(target, cuda_tokenizer, PROMPT, method=method, max_new_tokens=8, **options)  # graphs captured
    with count_host_reads(DEVICE) as reads:
        result = accelgen.generate(target, cuda_tokenizer, PROMPT, method=method, max_new_tokens=40, **options)
    assert reads.count <= bound * result.stats["target_forwards"] + 2
