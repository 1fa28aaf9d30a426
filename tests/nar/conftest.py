"""Shared by the NAR tests: SmolLM2's tokenizer alone (no model), a tiny word-copy corpus encoded through a compact
vocabulary, and a tiny backbone config. The task (summary = the words the function returns) is learnable in a
few dozen steps, so that training and decoding can be checked against references."""

from __future__ import annotations

import random

import pytest
import torch

from accelgen.nar.backbone import BackboneConfig
from accelgen.nar.tokens import Vocabulary, encode_pairs

WORDS = "apple river stone cloud green seven quick lamp paper window horse music".split()


@pytest.fixture(autouse=True)
def one_thread_for_tiny_models(one_thread):
    """Tiny models run fastest on one thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from transformers import AutoTokenizer

    from accelgen.models.loading import prepare_embedded

    return AutoTokenizer.from_pretrained(prepare_embedded("smollm2-135m"))


def copy_pairs(count: int, seed: int) -> list[tuple[str, str]]:
    """(source, summary): a function returning 2-5 distinct words, and those words."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        words = " ".join(rng.sample(WORDS, rng.randint(2, 5)))
        pairs.append((f"def f():\n    return {words}", words))
    return pairs


@pytest.fixture(scope="session")
def copy_task(smollm_tokenizer):
    """(vocabulary, train rows, held-out rows, held-out pairs) of the word-copy corpus."""
    train_pairs, held_out_pairs = copy_pairs(400, seed=0), copy_pairs(48, seed=1)
    vocabulary = Vocabulary.from_texts(smollm_tokenizer, [text for pair in train_pairs for text in pair], 64)

    def encode(pairs):
        return encode_pairs(vocabulary, pairs, max_source_len=32, max_target_len=12)

    return vocabulary, encode(train_pairs), encode(held_out_pairs), held_out_pairs


def tiny_backbone(vocab_size: int, **changes) -> BackboneConfig:
    """A tiny backbone config over the copy task (dropout off: decoding tests compare exactly)."""
    sizes = dict(vocab_size=vocab_size, width=64, heads=4, encoder_layers=1, decoder_layers=1, feedforward=128,
                 max_source_len=32, max_target_len=12, dropout=0.0)
    return BackboneConfig(**{**sizes, **changes})


@pytest.fixture
def tiny_config(copy_task):
    """tiny_config(**changes): a tiny backbone config over the copy task's vocabulary."""
    return lambda **changes: tiny_backbone(len(copy_task[0]), **changes)


@pytest.fixture(scope="session")
def seeded():
    """seeded(cls, config, **options): a model built after torch.manual_seed(0), so its weights are the same
    every time."""

    def build(cls, config, **options):
        torch.manual_seed(0)
        return cls(config, **options).eval()

    return build


@pytest.fixture(scope="session")
def trained(copy_task, seeded):
    """trained(cls, steps, **options): a tiny model of cls trained `steps` steps on the copy task (once per
    session; don't change it)."""
    from accelgen.nar.train import TrainSettings, train_model

    models = {}

    def train(cls, steps: int, **options):
        key = (cls, steps, tuple(sorted(options.items())))
        if key not in models:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            model = seeded(cls, tiny_backbone(len(copy_task[0])), **options)
            train_model(model, copy_task[1], TrainSettings(steps=steps, batch_size=32, learning_rate=3e-3))
            torch.set_num_threads(threads)
            models[key] = model
        return models[key]

    return train
