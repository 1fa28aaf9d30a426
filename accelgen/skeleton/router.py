"""Skeleton-of-Thought's router (SoT-R, Ning et al. 2023, arXiv:2307.15337, section 4): a small classifier that
says whether a question suits SoT, on the model's own features of the question.

Features: the mean of the model's final (normed) hidden states over the question's tokens, the question's text
alone (no chat template), its first FEATURE_TOKENS tokens. Classifier: logistic regression on those features,
standardised with the training set's mean and spread. Labels: the paper's prompting router asked of a larger
model (asking.py: `router_label`), cached by labels.py; the router thus learns to predict, from one forward of the
small model, what the larger model would say, without running it.

A router belongs to the model whose features it read: it is saved with that model's shape and refused by another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from accelgen.errors import InputError
from accelgen.heads.io import check_fits, load_heads, save_heads
from accelgen.train.loop import ScaleOut, run_training, training_device

NAME = "sot_router"
TRAIN_COMMAND = "accelgen train sot-router"
FEATURE_TOKENS = 512  # a question's first tokens read for its features (ShareGPT questions run to 2,000 characters)


@dataclass(frozen=True)
class RouterConfig:
    steps: int = 300
    learning_rate: float = 0.05
    # few labels and many features: an L2 penalty keeps the labels from being memorised
    penalty: float = field(default=0.05, metadata={"help": "L2 penalty on the router's weights."})
    held_out: float = field(default=0.25, metadata={"help": "Share of the questions kept out of training."})
    threshold: float = field(default=0.5, metadata={"help": "SoT where the router's probability reaches it."})
    seed: int = 0

    def __post_init__(self):
        if self.steps < 1 or self.learning_rate <= 0 or self.penalty < 0:
            raise InputError("steps and learning rate must be positive and the penalty non-negative")
        if not 0.0 < self.held_out < 1.0 or not 0.0 < self.threshold < 1.0:
            raise InputError(f"held_out and threshold must lie in (0, 1), got {self.held_out} and {self.threshold}")


class SkeletonRouter(nn.Module):
    """Logistic regression over standardised question features of one model."""

    def __init__(self, hidden_size: int, layer_count: int, vocab_size: int, base_model: str | None = None,
                 threshold: float = 0.5):
        super().__init__()
        self.hidden_size, self.layer_count, self.vocab_size = hidden_size, layer_count, vocab_size
        self.base_model = base_model
        self.threshold = threshold
        self.register_buffer("feature_mean", torch.zeros(hidden_size))
        self.register_buffer("feature_scale", torch.ones(hidden_size))
        self.linear = nn.Linear(hidden_size, 1)

    @classmethod
    def for_model(cls, model, base_model: str | None = None, threshold: float = 0.5) -> "SkeletonRouter":
        config = model.config
        return cls(config.hidden_size, config.num_hidden_layers, config.vocab_size, base_model, threshold)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features (n, hidden_size) -> (n,) logits of "suits SoT"."""
        return self.linear((features - self.feature_mean) / self.feature_scale)[:, 0]

    def probability(self, features: torch.Tensor) -> torch.Tensor:
        """features (n, hidden_size) -> (n,) probabilities that each question suits SoT."""
        with torch.no_grad():
            return torch.sigmoid(self(features.float()))

    def accepts(self, model, tokenizer, question: str) -> tuple[bool, float]:
        """(whether the question suits SoT, the probability it does), from one forward of `model`."""
        self.check_fits(model)
        score = float(self.probability(question_features(model, tokenizer, [question]))[0])
        return score >= self.threshold, score

    def describe_shape(self) -> dict:
        return {"hidden_size": self.hidden_size, "layer_count": self.layer_count, "vocab_size": self.vocab_size}

    def check_fits(self, model) -> None:
        check_fits(self.describe_shape(), model, f"this SoT router (trained for {self.base_model or 'another model'})")

    def save(self, folder) -> None:
        """sot_router.safetensors and sot_router.json in folder, each written atomically, the config last."""
        save_heads(self, folder, NAME, {**self.describe_shape(), "base_model": self.base_model,
                                        "threshold": self.threshold})

    @classmethod
    def load(cls, folder, model=None) -> "SkeletonRouter":
        """A router saved by `save`; with a model, a clear error unless it was trained for a model of its shape."""
        router = load_heads(cls, folder, NAME, TRAIN_COMMAND)
        if model is not None:
            router.check_fits(model)
        return router


@torch.inference_mode()
def question_features(model, tokenizer, questions: list[str],
                      progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """(len(questions), hidden_size) float32: each question's mean final hidden state (module docstring);
    progress(questions done)."""
    if not isinstance(model, nn.Module):
        raise InputError("the SoT router reads the model's hidden states: load the model in a PyTorch format "
                         "(weights fp32, bf16, int8 or int4), not with the llama.cpp engine")
    rows = []
    for question in questions:
        ids = tokenizer(question, add_special_tokens=False).input_ids[:FEATURE_TOKENS] or [tokenizer.eos_token_id]
        hidden = model.base_model(input_ids=torch.tensor([ids], device=model.device)).last_hidden_state  # (1, n, d)
        rows.append(hidden[0].float().mean(0).cpu())
        if progress is not None:
            progress(len(rows))
    return torch.stack(rows)


def held_out_split(count: int, share: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training indices, held-out indices): a seeded shuffle of range(count), at least one of each."""
    if count < 2:
        raise InputError(f"the router needs at least 2 labelled questions, got {count}")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    held = min(count - 1, max(1, round(count * share)))
    return order[held:], order[:held]


def train_router(router: SkeletonRouter, features: torch.Tensor, labels: torch.Tensor, config: RouterConfig,
                 progress: Callable[[dict], None] | None = None, scale: ScaleOut | None = None) -> SkeletonRouter:
    """Fit the router to features (n, d) float32 and labels (n,) 0/1 in full-batch Adam steps on the logistic loss
    (the rarer label weighted up so that both count equally) plus config.penalty times the squared weights, which
    keeps a few hundred labels from being memorised by a thousand features; scale: processes, precision,
    accumulation (train/loop.py). Returns the router, trained in place, back on the device it came on."""
    labels = labels.float()
    positives = float(labels.sum())
    if positives in (0.0, float(len(labels))):
        raise InputError(f"every training label is {int(labels[0])}: a router needs questions of both kinds")
    torch.manual_seed(config.seed)
    device = router.feature_mean.device
    router.feature_mean.copy_(features.mean(0))
    router.feature_scale.copy_(features.std(0).clamp_min(1e-6) if len(features) > 1 else torch.ones_like(features[0]))
    pos_weight = torch.tensor((len(labels) - positives) / positives)
    logistic_loss = nn.BCEWithLogitsLoss(pos_weight=pos_weight).to(training_device(scale))
    optimizer = torch.optim.Adam(router.parameters(), lr=config.learning_rate)

    def loss_of(batch: dict) -> tuple[torch.Tensor, dict]:
        fit = logistic_loss(router(batch["features"]), batch["labels"])
        # the whole penalty in every micro-batch's mean: the loop weighs those by their shares, which sum to 1
        return fit + config.penalty * router.linear.weight.square().sum(), {"logistic_loss": fit.item()}

    run_training(router, optimizer, config.steps, lambda step: {"features": features, "labels": labels}, loss_of,
                 scale=scale, progress=progress)
    return router.to(device).eval()


def router_accuracy(router: SkeletonRouter, features: torch.Tensor, labels: torch.Tensor) -> dict:
    """Accuracy of the router's decisions on features (n, d) against labels (n,), beside the accuracy of always
    answering the majority label, and the balanced accuracy (mean of the two labels' recalls)."""
    decided = (router.probability(features) >= router.threshold).long()
    labels = labels.long()
    recalls = [float((decided[labels == label] == label).float().mean()) for label in (0, 1) if (labels == label).any()]
    positives = int(labels.sum())
    return {
        "questions": len(labels),
        "suits_sot": positives,
        "accuracy": float((decided == labels).float().mean()),
        "majority_accuracy": max(positives, len(labels) - positives) / len(labels),
        "balanced_accuracy": sum(recalls) / len(recalls) if recalls else math.nan,
        "accepted": int(decided.sum()),
    }
