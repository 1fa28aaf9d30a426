"""SoT's router: it learns labels from features, saves and loads whole, and refuses a model it was not made for;
its labels are cached and reused."""

import copy
import json

import pytest
import torch

from accelgen.skeleton import labels
from accelgen.skeleton.asking import calibrated_label, letter_probabilities, pairwise_verdict
from accelgen.skeleton.router import (RouterConfig, SkeletonRouter, held_out_split, question_features,
                                      router_accuracy, train_router)
from accelgen.train.loop import ScaleOut

QUESTIONS = ["How can I sleep better?", "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n",
             "Tips for a job interview?"]


def separable(count: int, size: int = 64, seed: int = 0):
    """(features (count, size), labels): random labels, which shift the first 8 features by +-1.5; noise elsewhere."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (count,), generator=generator)
    features = torch.randn(count, size, generator=generator)
    features[:, :8] += 1.5 * (2 * labels[:, None] - 1)
    return features, labels


def test_the_router_learns_labels_it_can_separate(tiny_target):
    features, labels = separable(80)
    training, held = held_out_split(80, 0.25, seed=0)
    router = SkeletonRouter.for_model(tiny_target, "tiny")
    before = router_accuracy(router, features[held], labels[held])["accuracy"]
    train_router(router, features[training], labels[training], RouterConfig(steps=100))
    after = router_accuracy(router, features[held], labels[held])
    assert after["accuracy"] >= 0.9 > before
    assert after["questions"] == 20 and 0.5 <= after["majority_accuracy"] < 1


def test_micro_batches_train_the_router_the_whole_set_does(tiny_target):
    features, labels = separable(40)
    untrained = SkeletonRouter.for_model(tiny_target, "tiny")
    whole, accumulated = (train_router(copy.deepcopy(untrained), features, labels, RouterConfig(steps=3), scale=scale)
                          for scale in (ScaleOut(), ScaleOut(grad_accum=2)))
    for name, value in whole.state_dict().items():  # the rounding of summing in parts, through 3 Adam steps of lr 0.05
        torch.testing.assert_close(accumulated.state_dict()[name], value, rtol=0, atol=5e-6)


def test_a_router_needs_both_kinds_of_question(tiny_target):
    with pytest.raises(ValueError, match="both kinds"):
        train_router(SkeletonRouter.for_model(tiny_target), torch.randn(4, 64), torch.ones(4), RouterConfig(steps=1))


def test_save_and_load_keep_the_routers_calls(tiny_target, tokenizer, tmp_path):
    features, labels = separable(40)
    router = train_router(SkeletonRouter.for_model(tiny_target, "tiny", threshold=0.4), features, labels,
                          RouterConfig(steps=20))
    router.save(tmp_path)
    loaded = SkeletonRouter.load(tmp_path, tiny_target)
    assert loaded.threshold == 0.4 and loaded.base_model == "tiny"
    torch.testing.assert_close(loaded.probability(features), router.probability(features))
    assert loaded.accepts(tiny_target, tokenizer, QUESTIONS[0]) == router.accepts(tiny_target, tokenizer, QUESTIONS[0])


def test_a_router_for_another_model_is_refused(tiny_target, make_tiny_model, tokenizer, tmp_path):
    SkeletonRouter.for_model(tiny_target, "tiny").save(tmp_path)
    other = make_tiny_model(layers=3)
    with pytest.raises(ValueError, match="SoT router .*tiny.* do not fit this model: layer count 2, the model's is 3"):
        SkeletonRouter.load(tmp_path, other)
    with pytest.raises(ValueError, match="do not fit"):
        SkeletonRouter.load(tmp_path).accepts(other, tokenizer, QUESTIONS[0])
    with pytest.raises(FileNotFoundError, match="accelgen train sot-router"):
        SkeletonRouter.load(tmp_path / "nothing")


def test_features_are_one_row_per_question_and_do_not_depend_on_the_others(tiny_target, tokenizer):
    features = question_features(tiny_target, tokenizer, QUESTIONS)
    assert features.shape == (3, 64) and features.dtype == torch.float32
    torch.testing.assert_close(question_features(tiny_target, tokenizer, QUESTIONS[1:2])[0], features[1])


def test_labels_are_asked_once_then_read_from_the_cache(tiny_target, tokenizer, tmp_path, monkeypatch):
    path = tmp_path / "labels.json"
    first = labels.cached_labels(tiny_target, tokenizer, QUESTIONS, path, "tiny")
    cache = json.loads(path.read_text())
    assert set(first) <= {0, 1} and len(cache["answers"]) == 3 and set(cache["bias"]) == {"A", "B", "C"}
    monkeypatch.setattr(labels, "router_probabilities", lambda *args: pytest.fail("asked again"))
    monkeypatch.setattr(labels, "content_free_bias", lambda *args: pytest.fail("asked again"))
    assert labels.cached_labels(tiny_target, tokenizer, QUESTIONS[::-1], path, "tiny") == first[::-1]
    with pytest.raises(ValueError, match="labels by 'tiny'.*not by 'other'"):
        labels.cached_labels(tiny_target, tokenizer, QUESTIONS, path, "other")


def test_a_label_says_which_answer_the_question_made_likelier_than_the_labellers_habit():
    habit = {"A": 0.44, "B": 0.41, "C": 0.15}
    assert calibrated_label({"A": 0.42, "B": 0.42, "C": 0.16}, habit) == 0  # A is still the likeliest, but fell
    assert calibrated_label({"A": 0.48, "B": 0.38, "C": 0.14}, habit) == 1
    assert calibrated_label(habit, habit) == 0  # the question changed nothing


def test_the_judge_and_the_labeller_answer_with_a_letter(tiny_target, tokenizer):
    probabilities = letter_probabilities(tiny_target, tokenizer, [5, 17, 923], ("A", "B", "C"))
    assert set(probabilities) == {"A", "B", "C"} and sum(probabilities.values()) == pytest.approx(1.0)
    verdict, _ = pairwise_verdict(tiny_target, tokenizer, QUESTIONS[0], "Sleep more.", "Drink coffee.")
    assert verdict in ("first", "second", "tie")
