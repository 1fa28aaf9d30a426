"""The core methods on a CUDA device: token-for-token plain greedy decoding in fp32, trees and caches included.

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
    baseline = accelgen.generate(target, cuda_tokenizer, PROMPT, method="autoregressive", max_new_tokens=40)
    result = accelgen.generate(target, cuda_tokenizer, PROMPT, method=method, max_new_tokens=40,
                               draft_model=draft if needs_draft else None, **options)
    assert result.token_ids == baseline.token_ids
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
