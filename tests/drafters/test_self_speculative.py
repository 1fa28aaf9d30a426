"""Self-speculative decoding: the target drafts with layers skipped; lossless, exact sampling, tuned skip sets."""

import json

import pytest
import torch

import accelgen
from accelgen.drafters.self_speculative import SKIP_FILE, default_skip, resolve_skip
from accelgen.draft import ROOT, tree_attention
from accelgen.drafters.self_speculative import skipping_runner
from accelgen.models.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]
SKIP_SECOND = {"skip_attention": [1], "skip_mlp": [1]}


def test_skipping_nothing_is_the_model_itself(tiny_target, assert_reordered):
    """The runner's own walk through the modules gives the model's logits, for a chain and then a tree."""
    ours, reference = skipping_runner(tiny_target, [], []), ModelRunner(tiny_target)
    assert_reordered(ours.forward(torch.tensor(PROMPT)), reference.forward(torch.tensor(PROMPT)))
    tree = tree_attention(torch.tensor([ROOT, 0, ROOT]))[1:, 1:]
    assert_reordered(ours.forward(torch.tensor([3, 4, 5]), tree), reference.forward(torch.tensor([3, 4, 5]), tree))
    assert ours.length == reference.length == len(PROMPT) + 3


def test_skipped_layers_change_the_draft_and_leave_their_cache_empty(tiny_target):
    runner = skipping_runner(tiny_target, skip_attention=[0], skip_mlp=[1])
    logits = runner.forward(torch.tensor(PROMPT))
    assert not torch.allclose(logits, ModelRunner(tiny_target).forward(torch.tensor(PROMPT)))
    assert not runner.cache.layers[0].is_initialized and runner.length == len(PROMPT)  # read from layer 1
    runner.keep(3, [])
    assert runner.length == 3


def test_lossless_with_partial_acceptance(tiny_target, tokenizer, assert_lossless):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "self-speculative", 30,
                             draft_budget="method", skip=SKIP_SECOND)
    assert 0 < result.stats["acceptance_rate"] < 1


def test_smollm_default_skip_is_lossless(smollm, assert_lossless):
    model, tokenizer = smollm
    chat = [{"role": "user", "content": "Write a Python function that returns the squares of a list."}]
    result = assert_lossless(model, tokenizer, chat, "self-speculative", 24, draft_budget="method", skip="default")
    assert result.stats["mean_accepted_tokens"] > 1.0


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(assert_samples_target):
    assert_samples_target("self-speculative", [1, 3, 4], skip=SKIP_SECOND)


def test_tuned_skip_set_is_read_from_beside_the_model(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_target, "name_or_path", str(tmp_path), raising=False)
    assert resolve_skip(tiny_target, "tuned") == default_skip(2) == {"skip_attention": [1], "skip_mlp": [1]}
    (tmp_path / SKIP_FILE).write_text(json.dumps({"skip": {"skip_attention": [0], "skip_mlp": []}}))
    assert resolve_skip(tiny_target, "tuned") == {"skip_attention": [0], "skip_mlp": []}


@pytest.mark.parametrize("skip, problem", [
    ({"skip_attention": [0, 1]}, "every attention layer"),
    ({"skip_mlp": [7]}, "layers 0..1, not \\[7\\]"),
    ({"skip_ffn": [1]}, "not skip_ffn"),
    ("fast", "'tuned', 'default' or a dict"),
])
def test_bad_skip_sets_are_named(tiny_target, tokenizer, skip, problem):
    with pytest.raises(ValueError, match=problem):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="self-speculative", skip=skip)
