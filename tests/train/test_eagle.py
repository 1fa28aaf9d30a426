"""EAGLE head training: an untrained head passes the feature through, training beats it on held-out windows,
checkpoints resume, the target's features are cached once, the draft vocabulary and the command line (the
exports to vLLM and SGLang: tests/test_export.py)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import accelgen
from accelgen.cli import app
from accelgen.heads.eagle import new_head
from accelgen.train import eagle
from accelgen.train.eagle import EagleConfig, collect_features, evaluate_eagle, train_eagle
from accelgen.train.layerskip import packed_windows


SMALL = dict(batch_size=4, learning_rate=1e-2, ce_weight=1.0, noise=0.0, draft_vocab=0)


@pytest.fixture(scope="module")
def data(tiny_target, tokenizer):
    """(windows, features, choices) of the tiny target's own greedy text: 12 windows of 32 tokens."""
    texts = [tokenizer.decode(accelgen.generate(tiny_target, tokenizer, [start, 17, 923], max_new_tokens=40).token_ids)
             for start in range(5, 17)]
    windows = packed_windows(tokenizer, texts, seq_len=32, count=12)
    return (windows, *collect_features(tiny_target, windows))


def test_training_beats_the_untrained_head_on_held_out_windows(smollm):
    """SmolLM2 on ShareGPT text: a few seconds of training make the head's guesses of the model's next choice on
    windows it never saw better than the untrained head's."""
    from accelgen.cli.datastore import dataset_texts

    model, tokenizer = smollm
    windows = packed_windows(tokenizer, dataset_texts("sharegpt"), seq_len=64, count=24)
    features, choices = collect_features(model, windows)
    held, train = slice(0, 8), slice(8, None)
    before = evaluate_eagle(model, new_head(model), windows[held], features[held], choices[held])
    head, _ = train_eagle(model, windows[train], features[train], choices[train],
                          EagleConfig(steps=25, batch_size=4, learning_rate=1e-3, draft_vocab=0))
    after = evaluate_eagle(model, head, windows[held], features[held], choices[held])
    assert after["top1"] > before["top1"] + 0.05 and after["top5"] >= after["top1"], (before, after)


def test_checkpoints_resume(tiny_target, data, tmp_path):
    windows, features, choices = data
    _, first = train_eagle(tiny_target, windows, features, choices, EagleConfig(steps=4, checkpoint_every=2, **SMALL),
                           tmp_path)
    _, second = train_eagle(tiny_target, windows, features, choices, EagleConfig(steps=6, checkpoint_every=2, **SMALL),
                            tmp_path)
    assert (first["resumed_at"], second["resumed_at"]) == (0, 4)
    assert torch.load(tmp_path / eagle.CHECKPOINT, weights_only=True)["step"] == 6
    with pytest.raises(ValueError, match="other settings"):
        train_eagle(tiny_target, windows, features, choices, EagleConfig(steps=8, checkpoint_every=2,
                                                                         **{**SMALL, "learning_rate": 0.5}), tmp_path)


def test_features_are_cached_once(tiny_target, data, tmp_path, monkeypatch):
    windows, features, choices = data
    first = eagle.cached_features(tiny_target, windows, tmp_path)
    monkeypatch.setattr(eagle, "collect_features", lambda *args, **kwargs: pytest.fail("features computed twice"))
    again = eagle.cached_features(tiny_target, windows, tmp_path)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1]) and torch.equal(again[1], choices)


def test_a_damaged_feature_cache_is_computed_again(tiny_target, data, tmp_path, capsys):
    windows, features, choices = data
    eagle.cached_features(tiny_target, windows, tmp_path)
    path = tmp_path / eagle.FEATURES
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    again = eagle.cached_features(tiny_target, windows, tmp_path)
    assert torch.equal(again[0], features) and torch.equal(again[1], choices)
    assert f"{path} is unreadable" in capsys.readouterr().err  # the warning names the file
    assert torch.equal(load_file(path)["features"], features)  # and it is whole again


def test_the_command_trains_a_head_that_generate_uses(command_inputs, tokenizer, tmp_path):
    folder, dataset = command_inputs(seed=0)
    out = tmp_path / "eagle"
    run = CliRunner().invoke(app, ["train", "eagle", "--model", str(folder), "--dataset", dataset, "--out", str(out),
                                   "--windows", "8", "--held-out", "2", "--seq-len", "16", "--steps", "6",
                                   "--draft-vocab", "512"])
    assert run.exit_code == 0, run.output
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert evaluation["draft_vocab"] == 512 and 0 <= evaluation["top1"] <= evaluation["top5"] <= 1
    assert (out / eagle.FEATURES).exists() and (out / eagle.CHECKPOINT).exists()
    runs = [CliRunner().invoke(app, ["generate", "def add(a, b):", "--model", str(folder), "-n", "10", "--json",
                                     *extra]) for extra in ([], ["--method", "eagle", "--head", str(out)])]
    assert all(result.exit_code == 0 for result in runs), runs[1].output
    plain, drafted = (json.loads(result.stdout.strip().splitlines()[-1]) for result in runs)
    assert drafted["token_ids"] == plain["token_ids"]
