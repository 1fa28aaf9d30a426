"""Medusa and blockwise drafting from heads trained for a few steps: token-for-token greedy decoding with drafts
partly accepted (static, dynamic and chain trees, a draft vocabulary), the target's distribution when sampling,
and clear errors for missing or unfit heads."""

import pytest
import torch

import accelgen
from accelgen.heads.medusa import MedusaHeads
from accelgen.train.eagle import collect_features
from accelgen.train.medusa import MedusaConfig, train_medusa

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]


def trained_heads(model, windows, folder, draft_vocab: int = 0) -> str:
    """Heads trained on the model's own greedy continuations, so that they are right part of the time."""
    heads, _ = train_medusa(model, windows, *collect_features(model, windows),
                            MedusaConfig(heads=3, steps=150, batch_size=128, learning_rate=1e-2, draft_vocab=draft_vocab))
    heads.save(folder)
    return str(folder)


@pytest.fixture(scope="module")
def heads_folder(tiny_target, tiny_target_windows, tmp_path_factory):
    return trained_heads(tiny_target, tiny_target_windows, tmp_path_factory.mktemp("medusa"))


@pytest.mark.parametrize("method, options", [("blockwise", {}), ("medusa", {}),
                                             ("medusa", {"paths": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]}),
                                             ("medusa", {"width": 2, "max_nodes": 5})])
def test_trained_heads_are_lossless_with_partial_acceptance(tiny_target, tokenizer, heads_folder, assert_lossless,
                                                            method, options):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, method, 40, heads=heads_folder, **options)
    assert 0 < result.stats["acceptance_rate"] < 1


def test_heads_with_a_draft_vocabulary_are_lossless(tiny_target, tokenizer, tiny_target_windows, assert_lossless,
                                                    tmp_path):
    folder = trained_heads(tiny_target, tiny_target_windows, tmp_path, draft_vocab=200)
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "medusa", 40, heads=folder)
    assert 0 < result.stats["acceptance_rate"] < 1


def test_untrained_heads_are_lossless_too(tiny_target, tokenizer, assert_lossless, tmp_path):
    MedusaHeads(2, 64, 49152).save(tmp_path / "untrained")
    assert_lossless(tiny_target, tokenizer, PROMPT, "medusa", 12, heads=str(tmp_path / "untrained"), paths=[[0], [0, 0]])


def test_a_short_budget_cuts_the_tree(tiny_target, tokenizer, heads_folder, assert_lossless):
    for budget in (1, 2, 3):
        assert_lossless(tiny_target, tokenizer, PROMPT, "medusa", budget, heads=heads_folder)


@pytest.mark.parametrize("options, problem", [
    ({}, "needs trained Medusa heads"),
    ({"paths": [[0, 0]]}, "needs its prefix \\[0\\]"),
    ({"paths": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}, "guess only 3 tokens ahead"),
    ({"width": 2, "depth": 4}, "deeper than the 3 tokens the heads guess ahead"),
])
def test_bad_input_is_named(tiny_target, tokenizer, heads_folder, options, problem):
    options = {"heads": heads_folder, **options} if options else {}
    with pytest.raises(ValueError, match=problem):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="medusa", **options)


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
@pytest.mark.parametrize("method, options", [("medusa", {"paths": [[0], [1], [0, 0]]}),
                                             ("medusa", {"width": 2, "max_nodes": 4}), ("blockwise", {})])
def test_sampling_keeps_the_target_distribution(sampling_model, assert_samples_target, tmp_path, method, options):
    heads = MedusaHeads(2, sampling_model.config.hidden_size, sampling_model.config.vocab_size)
    with torch.no_grad():  # heads whose guesses differ from the target's, drafts right only part of the time
        for index, block in enumerate(heads.blocks):
            block.weight.copy_(torch.randn(block.weight.shape, generator=torch.Generator().manual_seed(index)))
    heads.save(tmp_path)
    assert_samples_target(method, [1, 4, 6], heads=str(tmp_path), **options)


def test_heads_of_another_model_are_refused(make_tiny_model, tokenizer, heads_folder):
    wider = make_tiny_model("qwen2", seed=0, vocab_size=1000)
    with pytest.raises(ValueError, match="medusa heads .* do not fit this model: vocabulary 49152"):
        accelgen.generate(wider, tokenizer, [5, 6], method="blockwise", heads=heads_folder)


def test_the_command_line_takes_heads(tiny_target, tokenizer, heads_folder, tmp_path):
    import json

    from typer.testing import CliRunner

    from accelgen.cli import app

    tiny_target.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    runs = {method: CliRunner().invoke(app, ["generate", "def add(a, b):", "--model", str(tmp_path / "tiny"), "-n", "12",
                                             "--method", method, "--json", *(["--heads", heads_folder] if heads else [])])
            for method, heads in (("autoregressive", False), ("medusa", True))}
    assert all(run.exit_code == 0 for run in runs.values()), runs["medusa"].output
    plain, medusa = (json.loads(run.stdout.strip().splitlines()[-1]) for run in runs.values())
    assert medusa["token_ids"] == plain["token_ids"] and medusa["stats"]["target_forwards"] <= plain["stats"]["target_forwards"]


def test_typical_acceptance_accepts_more_than_greedy_and_is_measured(tiny_target, tokenizer, heads_folder):
    chain = [[0], [0, 0], [0, 0, 0]]
    greedy = accelgen.generate(tiny_target, tokenizer, PROMPT, method="medusa", max_new_tokens=40, heads=heads_folder,
                               paths=chain)
    typical = accelgen.generate(tiny_target, tokenizer, PROMPT, method="medusa-typical", max_new_tokens=40,
                                heads=heads_folder, paths=chain, epsilon=0.0, delta=0.0)  # threshold 0: all pass
    assert typical.stats["acceptance_rate"] == 1.0 > greedy.stats["acceptance_rate"]
    assert typical.token_ids != greedy.token_ids
